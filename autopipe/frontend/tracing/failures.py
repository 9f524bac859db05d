"""Why a trace failed, in one TraceError line: each tracer's failure, the advice that applies.

capture.py tries torch.fx, then torch.export ([Note: two tracers, one contract]); each attempt
that fails leaves a :class:`Failure` (the tracer, the first line of its error, the user's line:
[Note: the user's line] in diagnose.py). When both fail, :func:`advice` picks the fix to name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autopipe.errors import TraceError, first_line
from autopipe.frontend.tracing.modes import MODE_NAMES
from autopipe.frontend.tracing.node_values import GraphRunError
from executor._torch_compat import tree_leaves

__all__ = ["Failure", "advice", "graph_failure", "refuse_batched_kwargs", "untraceable"]


@dataclass
class Failure:
    """Why one tracer could not capture the model, for the one-line TraceError."""

    tracer: str
    cause: str  # first_line(err)
    line: str = ""  # the user's line (see [Note: the user's line]), or ""
    module: str | None = None  # torch.fx: the submodule it broke in ("" for the root)

    def __str__(self) -> str:
        where = ""
        if self.module is not None:
            where = f" in module '{self.module}'" if self.module else " in the model's own forward"
        at = f" at {self.line}" if self.line else ""
        return f"{self.tracer} failed{where}{at} ({self.cause})"


def graph_failure(err: Exception) -> Failure:
    line = err.line if isinstance(err, GraphRunError) else ""
    cause = err.err if isinstance(err, GraphRunError) else err
    return Failure("torch.fx", f"its graph did not run on the example inputs: {first_line(cause)}",
                   line)


_DATA_DEPENDENT = ("data-dependent", "control flow", "Proxy", "symbolically traced")


def refuse_batched_kwargs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    rows = {int(x.shape[0]) for x in tree_leaves(args) if isinstance(x, torch.Tensor) and x.dim()}
    for key, value in kwargs.items():
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() and int(leaf.shape[0]) in rows:
                raise TraceError(_batched_kwarg(key, int(leaf.shape[0])))


def _batched_kwarg(key: str, rows: int) -> str:
    return (f"kwargs[{key!r}] is a tensor of {rows} rows, like the inputs' batch: kwargs are "
            "constants of the graph; pass it in example_kwargs= to make it a keyword input that "
            "the pipeline splits into micro-batches")


def advice(args: tuple[Any, ...], kwargs: Mapping[str, Any], fx_failure: Failure,
           ex_failure: Failure) -> str:
    rows = {int(x.shape[0]) for x in tree_leaves(args) if isinstance(x, torch.Tensor) and x.dim()}
    for key, value in kwargs.items():  # a whole batch passed as a constant, traced on a micro-batch
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() and rows and all(
                int(leaf.shape[0]) % r == 0 for r in rows
            ):
                return _batched_kwarg(key, int(leaf.shape[0]))
    line = ex_failure.line or fx_failure.line
    dynamic = any(m in f"{fx_failure.cause} {ex_failure.cause}" for m in _DATA_DEPENDENT)
    at = f" at {line}" if line else ""
    if dynamic or not line:
        fix = (f"remove the data-dependent Python control flow{at} (if/for on tensor values, "
               ".item(), int(tensor)) or pass the values it depends on as constant kwargs=...")
    else:
        fix = (f"the model's code{at} fails on these example inputs: check their shapes and "
               "dtypes against what that line expects")
    if fx_failure.module:  # a submodule: keeping it whole may let torch.fx trace the rest
        fix = (f"mark '{fx_failure.module}' a leaf (trace(..., leaf_modules=['{fx_failure.module}']"
               f")) so torch.fx keeps it whole, or {fix}")
    return fix[0].upper() + fix[1:]


def untraceable(traced: bool, failure: Failure | None) -> str:
    if failure is None:
        return ""
    return f"the model cannot be traced in {MODE_NAMES[not traced]} mode ({failure})"
