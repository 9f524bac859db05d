"""Keyword inputs of a pipeline: the names a call's keywords bind to, in the stages' order.

[Note: keyword inputs are positional inside] A pipeline's stages take positional values (the
linear-chain convention, executor/local/gpipe.py), so a model called as ``model(input_ids=...,
attention_mask=..., labels=...)`` runs as stages whose first one takes ``input_ids,
attention_mask, labels`` positionally. :class:`InputSignature` remembers that order: ``positional``
values first, then the ``keywords`` in order. ``bind`` turns ``pipe(*args, **kwargs)`` into that
tuple, which is then split into micro-batches like any positional input, and names a missing or
unexpected keyword in one line. Both runtimes take one (``GPipe(signature=...)``,
``DistributedPipeline(signature=...)``); autopipe's tracer builds it from the example keyword
inputs (autopipe/frontend/tracing/capture.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from executor.errors import ExecutorError

__all__ = ["InputSignature"]


@dataclass(frozen=True)
class InputSignature:
    """``positional`` values, then the ``keywords``, as stage 0 takes them positionally."""

    positional: int
    keywords: tuple[str, ...] = ()

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """``args`` and ``kwargs`` of one call as stage 0's positional inputs."""
        names = ", ".join(self.keywords) or "none"
        extra = [k for k in kwargs if k not in self.keywords]
        if extra:
            raise ExecutorError(
                f"unexpected keyword input {extra[0]!r}: the pipeline's keyword inputs are {names}; "
                "trace with it in example_kwargs to make it an input (constants go in kwargs=)")
        missing = [k for k in self.keywords if k not in kwargs]
        if missing:
            raise ExecutorError(
                f"keyword input {missing[0]!r} is missing: the pipeline was traced with keyword "
                f"inputs {names}; pass every one of them")
        if len(args) != self.positional:
            raise ExecutorError(
                f"got {len(args)} positional input(s) but the pipeline was traced with "
                f"{self.positional}; pass the same inputs as the example (keywords: {names})")
        return (*args, *(kwargs[k] for k in self.keywords))
