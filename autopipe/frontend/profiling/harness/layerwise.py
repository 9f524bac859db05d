"""Each layer alone on the device, with made-up inputs: profiling a model that never fits.

    for run in layer_by_layer(graph, args, device):     # one layer materialised at a time
        measure(run.call, run.values, run.state)         # run.reuse_of: measured already

[Note: layer by layer] The whole-model profiler (frontend/profiling/profiler.py) runs the traced graph
once to record every value, which needs the whole model and all of its activations on the
device. This path needs neither. For each layer it builds a standalone copy of the layer's
GraphModule whose parameters and buffers are its own, on the device: copies of real tensors,
or random values of the right shape, dtype and device for tensors on the meta device. Its
inputs are made from the shapes and dtypes the tracer recorded with fake tensors
(``node.meta["val"]``): the model's own inputs where the layer reads them (token ids keep
their valid range), random floats, integer zeros (a valid index into any table) and all-true
masks otherwise. The copy is dropped before the next layer is built, so the peak is one
layer's parameters plus its activations, not the model's.

[Note: identical layers] Layers with the same code, the same submodule types and settings,
the same parameter shapes and dtypes and the same input shapes and dtypes (the 32 decoder
blocks of a Llama) cost the same: with ``dedupe`` only the first is built and measured, the
others are yielded with ``reuse_of`` naming it.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from autopipe.frontend.building.materialize import retarget_graph_module
from autopipe.frontend.profiling.harness.layer_timing import storage_key
from autopipe.frontend.profiling.harness.replay import LayerCall, Values, graph_args, layer_calls
from autopipe.frontend.tracing.graph import LayerGraph
from executor._torch_compat import tree_map_only

__all__ = ["LayerRun", "layer_by_layer", "layer_signature"]


@dataclass
class LayerRun:
    """One layer ready to measure, or (``reuse_of``) one whose twin was measured already."""

    call: LayerCall
    values: Values
    state: set[int]  # storage pointers of the layer's own parameters and buffers
    signature: str
    reuse_of: str | None = None


def _describe(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("T", tuple(int(s) for s in value.shape), str(value.dtype))
    if isinstance(value, list | tuple):
        return tuple(_describe(v) for v in value)
    return ("V", repr(value))


def _target(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def layer_signature(call: LayerCall, inputs: Sequence[Any]) -> str:
    """What makes two layers cost the same ([Note: identical layers])."""
    position: dict[fx.Node, int] = {}
    parts: list[Any] = []
    for i, node in enumerate(call.module.graph.nodes):
        position[node] = i
        args = fx.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        if node.op == "call_module":
            sub = _target(call.module, str(node.target))
            state = [_describe(t) for t in (*sub.parameters(), *sub.buffers())]
            parts.append((node.op, type(sub).__qualname__, repr(sub), state, repr(args)))
        elif node.op == "get_attr":
            parts.append((node.op, _describe(_target(call.module, str(node.target)))))
        elif node.op == "placeholder":
            parts.append((node.op,))
        else:
            parts.append((node.op, str(node.target), repr(args)))
    parts.append(tuple(_describe(v) for v in inputs))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _real(t: Tensor, device: torch.device, buffer: bool) -> Tensor:
    """A real tensor like ``t`` on ``device``: a copy, or random values for a meta tensor."""
    if not t.is_meta:
        return t.detach().to(device, copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if out.is_floating_point():
        return out.uniform_(0.5, 1.0) if buffer else out.normal_(0.0, 0.02)
    if out.dtype == torch.bool:
        return out.fill_(True)
    return out.zero_()


def _standalone(call: LayerCall, device: torch.device) -> fx.GraphModule:
    """The layer's GraphModule with parameters and buffers of its own on ``device``."""
    root: dict[str, Any] = {}
    for node in call.module.graph.nodes:
        if node.op == "call_module":
            sub = copy.deepcopy(_target(call.module, str(node.target)))
            for module in sub.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        module._parameters[name] = nn.Parameter(_real(p, device, False),
                                                                requires_grad=p.requires_grad)
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = _real(b, device, True)
            root[str(node.target)] = sub
        elif node.op == "get_attr":
            t = _target(call.module, str(node.target))
            if isinstance(t, nn.Parameter):
                root[str(node.target)] = nn.Parameter(_real(t, device, False), t.requires_grad)
            elif isinstance(t, Tensor):
                root[str(node.target)] = _real(t, device, True)
            else:
                root[str(node.target)] = t
    graph = fx.Graph()
    graph.output(graph.graph_copy(call.module.graph, {}))
    module = fx.GraphModule(root, graph, class_name=type(call.module).__name__).train()
    retarget_graph_module(module, device)  # [Note: nested graphs] in building/materialize.py
    return module


def _made_up(value: Any, device: torch.device) -> Any:
    """Values like the traced ones: random floats (needing a gradient where the traced value
    did, as activations do), integer zeros, all-true masks."""

    def make(t: Tensor) -> Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        if out.is_floating_point():
            return out.normal_().requires_grad_(t.requires_grad)
        return out.fill_(True) if out.dtype == torch.bool else out.zero_()

    return tree_map_only(Tensor, make, value)


def _state(module: nn.Module) -> set[int]:
    return {storage_key(t)[0] for t in (*module.parameters(), *module.buffers())}


def layer_by_layer(
    g: LayerGraph, args: Sequence[Any], device: torch.device | str, *, dedupe: bool = True
) -> Iterator[LayerRun]:
    """Every layer of ``g`` alone on ``device`` ([Note: layer by layer]), in layer order.

    ``args``: the model's example inputs (one micro-batch, on any device); graph inputs are
    read from them, every other layer input is made up from its traced shape and dtype.
    """
    device = torch.device(device)
    given = dict(zip([n.name for n in g.gm.graph.nodes if n.op == "placeholder"],
                     graph_args(g, tuple(args)), strict=False))
    nodes = {n.name: n for n in g.gm.graph.nodes}
    seen: dict[str, str] = {}
    for call in layer_calls(g):
        traced = [given[name] if name in given else nodes[name].meta.get("val")
                  for name in call.inputs]
        signature = layer_signature(call, traced)
        if dedupe and signature in seen:
            yield LayerRun(call, Values(), set(), signature, reuse_of=seen[signature])
            continue
        seen.setdefault(signature, call.name)
        module = _standalone(call, device)
        values = Values({
            name: tree_map_only(Tensor, lambda t: t.to(device), given[name]) if name in given
            else _made_up(value, device)
            for name, value in zip(call.inputs, traced, strict=True)
        })
        yield LayerRun(LayerCall(call.name, module, call.inputs, call.outputs), values,
                       _state(module), signature)
