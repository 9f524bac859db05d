"""Measuring under a precision: every forward the profiler runs enters the stage's autocast.

[Note: profiling under a precision] ``profile(..., precision="bf16")`` measures what a pipeline
with that precision runs ([Note: mixed precision] in executor/precision.py): each call the
profiler times or probes (a layer alone, the harness's empty layer, the whole graph, its stamped
copy, executor.GPipe's stage calls, the loss, the model beside itself) enters
``precision_autocast`` around its FORWARD only, once per call, as a stage call does. So a
timed forward pays the casts of its weights every time (autocast's cast cache is emptied when
the region ends, and a stage's region is one call), the backward runs outside it on the dtypes
the forward chose, and a checkpointed call's recomputation re-enters it (the wrapper is the
checkpointed function). What autograd saves is then the precision's: low-dtype activations and
the low-dtype weight copies a matmul saves for its backward, which layer_timing.probe counts
(a cast copy is a tensor of its own, not a parameter's storage), as executor's ActivationMeter
does. Values that cross layers change dtype too, so under a precision other than fp32 the
edges' and outputs' bytes are re-measured from one forward of each layer under autocast
(:func:`layer_output_bytes`) instead of the fp32 trace's. Layer by layer ([Note: layer by
layer]) a layer's made-up inputs keep their traced (fp32) dtype, so an op that promotes to
its widest input (an add) may measure wider than in the real run. The graph is traced outside
autocast, so the stages built from it carry no autocast of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from autopipe.frontend.profiling.harness.layer_timing import fresh
from autopipe.frontend.profiling.harness.replay import LayerCall, Values
from autopipe.frontend.tracing.graph import LayerGraph
from autopipe.frontend.tracing.grouping import value_bytes
from executor.precision import precision_autocast

__all__ = ["AutocastStage", "as_stage", "autocast_call", "layer_output_bytes", "measured_edges"]


def autocast_call(fn: Callable[..., Any], precision: str, device: torch.device) -> Callable[..., Any]:
    """``fn`` whose every call runs under ``precision_autocast``; ``fn`` itself for fp32."""
    if precision == "fp32":
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        with precision_autocast(precision, device):
            return fn(*args, **kwargs)

    return call


class AutocastStage(nn.Module):
    """A stage module whose forward runs under ``precision_autocast`` (for executor.GPipe runs
    the profiler times: the empty stages of [Note: measured overheads], the whole graph)."""

    def __init__(self, module: nn.Module, precision: str, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.precision, self.device = precision, device

    def forward(self, *args: Any) -> Any:
        with precision_autocast(self.precision, self.device):
            return self.module(*args)


def as_stage(module: nn.Module, precision: str, device: torch.device) -> nn.Module:
    """``module`` as a stage computing under ``precision``; itself for fp32."""
    return module if precision == "fp32" else AutocastStage(module, precision, device)


def layer_output_bytes(call: LayerCall, values: Values) -> list[int]:
    """Bytes of each of ``call``'s outputs (``call.outputs`` order) in one forward under its
    precision, without autograd ([Note: profiling under a precision])."""
    with torch.no_grad():  # fresh copies: an in-place layer must not write the recorded values
        out = call(*fresh(call.arguments(values)))
    outs = out if isinstance(out, tuple) else (out,)  # a layer module returns a tuple of its outputs
    return [value_bytes(v) for v in outs]


def measured_edges(g: LayerGraph, node_bytes: Mapping[str, int]) -> tuple[list[tuple[str, str, int]],
                                                                           dict[str, int]]:
    """The graph's edges and each layer's output bytes with every layer output's measured bytes
    (``node_bytes``: fx node name -> bytes; a node not in it keeps the trace's), summed as the
    tracer sums them (autopipe.frontend.tracing.grouping.layer_attributes)."""
    edges: dict[tuple[str, str], int] = {}
    outputs: dict[str, int] = dict.fromkeys(g.layers, 0)
    for node in g.gm.graph.nodes:
        src = g.node_layer.get(node.name)
        if src is None or node.op == "get_attr":
            continue
        nbytes = node_bytes.get(node.name)
        if nbytes is None:
            nbytes = value_bytes(node.meta.get("val"))
        if any(u.op == "output" or g.node_layer.get(u.name) != src for u in node.users):
            outputs[src] += nbytes
        for dst in {g.node_layer[u.name] for u in node.users if u.name in g.node_layer} - {src}:
            edges[src, dst] = edges.get((src, dst), 0) + nbytes
    order = {n: i for i, n in enumerate(g.layers)}
    listed = sorted(((u, v, b) for (u, v), b in edges.items()), key=lambda e: (order[e[0]], order[e[1]]))
    return listed, outputs
