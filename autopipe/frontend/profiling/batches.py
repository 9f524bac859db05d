"""The example batch as ``profile()`` takes it, measured or estimated: keyword inputs and sizes.

    whole, inputs, tracer = keyword_inputs(model, example_inputs, example_kwargs, trace_kwargs)
    measured, frame, fingerprints = measure_sizes(measure_at, micro_inputs, graph, inputs, micro, others)

Both ways of making a profile (profiler.py measures, estimated/ counts: [Note: counted, not
timed]) read the caller's batch the same way and fill one table over its micro-batch sizes, so a
profile's rows and ``fwd_ms@R`` columns mean the same whichever way it was made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from torch import nn

from autopipe.core.scaling import SCALED_COLUMNS
from autopipe.errors import ProfileError, TraceError
from autopipe.frontend.profiling.corrections.in_sequence import SequenceScales
from autopipe.frontend.profiling.harness.inputs import with_rows
from autopipe.frontend.profiling.layer_rows import Edges
from autopipe.frontend.tracing.capture import default_kwargs
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.frontend.tracing.keyword_inputs import KeywordCall, split_keywords

__all__ = ["Measured", "keyword_inputs", "measure_sizes"]


@dataclass(frozen=True)
class Measured:
    """One micro-batch size measured, whole or layer by layer."""

    graph: LayerGraph
    rows: list[dict[str, Any]]  # every layer's profile row
    harness_ms: tuple[float, float]  # the layer harness's own forward, backward call
    recompute_ratio: float
    scales: SequenceScales  # the whole graph in sequence ([Note: layers in sequence])
    edges: Edges
    split_ratio: float | None  # the split backward's (I + W) / backward ([Note: split backward measured])


def keyword_inputs(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
                   trace_kwargs: Mapping[str, Any]
                   ) -> tuple[nn.Module, Any, Callable[[tuple[Any, ...]], LayerGraph]]:
    """(what runs the whole model on the graph's inputs, those inputs as one tuple, the tracer
    of a micro-batch of them): with ``example_kwargs``, the positional inputs then the batched
    keyword ones (split_keywords' order, as the pipelines take them), traced with the keywords
    and the constants as ``setup.traced`` traces a pipeline's, so that the fingerprints agree."""
    if example_kwargs is None:
        return model, example_inputs, lambda args: trace(model, args, **trace_kwargs)
    if not isinstance(example_kwargs, Mapping):
        raise ProfileError(f"example_kwargs must be a mapping of keyword inputs (an HF batch), got "
                           f"{type(example_kwargs).__name__}")
    try:
        batched, constants = split_keywords(model, example_kwargs, None)
    except TraceError as err:
        raise ProfileError(str(err)) from None
    if not batched:
        raise ProfileError("example_kwargs holds no tensor with a batch dimension: pass the batch's "
                           "tensors (input_ids=..., attention_mask=...), not only constants")
    positional = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    names, p = tuple(batched), len(positional)

    def tracer(args: tuple[Any, ...]) -> LayerGraph:
        keywords = {**dict(zip(names, args[p:], strict=True)), **constants}
        return trace(model, args[:p], example_kwargs=keywords, **trace_kwargs)

    whole = KeywordCall(model, p, names, {**constants, **default_kwargs(model, trace_kwargs.get("kwargs"))})
    return whole, (*positional, *batched.values()), tracer


def measure_sizes(measure_at: Callable[[tuple[Any, ...], LayerGraph | None], Measured],
                  inputs: tuple[Any, ...], graph: LayerGraph | None, example_inputs: Any, micro: int,
                  others: Sequence[int]) -> tuple[Measured, pd.DataFrame, dict[str, str]]:
    """The micro-batch ``inputs`` measured (on ``graph`` if given), then each of ``others``
    rows into columns ``fwd_ms@R`` ... ([Note: micro-batch scaling] in autopipe/core/scaling.py):
    the first size's Measured, the table, and the graph's fingerprint at every size."""
    measured = measure_at(inputs, graph)
    g = measured.graph
    frame = pd.DataFrame(measured.rows)
    fingerprints = {str(micro): g.fingerprint}
    for r in others:
        at_r = measure_at(with_rows(example_inputs, r), None)
        g_r, rows_r = at_r.graph, at_r.rows
        if g_r.layers != g.layers:
            raise ProfileError(f"at {r} rows the model traces to other layers than at {micro} "
                               f"({len(g_r.layers)} vs {len(g.layers)}); profile each size on "
                               "its own (micro_batch_sizes=None)")
        for column in SCALED_COLUMNS:
            frame[f"{column}@{r}"] = [row[column] for row in rows_r]
        fingerprints[str(r)] = g_r.fingerprint
    return measured, frame, fingerprints
