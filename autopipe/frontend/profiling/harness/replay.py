"""Replay a traced graph one layer at a time: real values for every node, one module per layer.

    args = graph_args(g, inputs)                     # positional + baked-in kwargs, flat
    values = record_values(g.gm, args)               # every node's real value, detached
    for call in layer_calls(g):                      # one GraphModule per layer
        out = call(*call.arguments(values))          # its module, under the call's precision

[Note: a layer is a standalone GraphModule] Because every layer is an interval of the graph
(see [Note: layers are intervals] in autopipe/frontend/tracing/graph.py), a layer can be cut out as its own small
fx graph whose placeholders are the values it reads from earlier layers (or the graph inputs)
and whose output is the tuple of values later layers read (a frontend.fx_cut.GraphCut). Layer
modules share the model's parameters; a tied weight is read by every layer that uses it and
never becomes a layer input ([Note: a cut reads parameters, never receives them]).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from autopipe.frontend.tracing.fx_cut import GraphCut
from autopipe.frontend.tracing.graph import LayerGraph
from executor._torch_compat import tree_map_only
from executor.precision import precision_autocast

__all__ = ["LayerCall", "Values", "graph_args", "record_values", "layer_calls"]


@dataclass
class Values:
    """Each fx node's value in one real run, as detached clones (leaves of their own).

    A recorded tensor keeps ``requires_grad`` of the value it copies, so a replayed layer
    computes exactly the input gradients the real backward pass computes: activations need
    them, graph inputs (images, token ids) do not.
    """

    value: dict[str, Any] = field(default_factory=dict)


@dataclass
class LayerCall:
    """One layer as a callable: ``module(*values of inputs) -> tuple(values of outputs)``;
    calling the LayerCall runs the module's forward under ``precision`` on ``device``
    ([Note: profiling under a precision] in precision.py)."""

    name: str
    module: fx.GraphModule
    inputs: list[str]  # fx node names read from outside the layer (earlier layers or inputs)
    outputs: list[str]  # fx node names read after the layer (later layers or the graph output)
    precision: str = "fp32"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def arguments(self, values: Values) -> list[Any]:
        return [values.value[n] for n in self.inputs]

    def __call__(self, *args: Any) -> Any:
        if self.precision == "fp32":
            return self.module(*args)
        with precision_autocast(self.precision, self.device):
            return self.module(*args)


def graph_args(g: LayerGraph, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The flat positional arguments of ``g.gm``: the inputs, then the baked-in kwargs.

    Both tracers' GraphModules accept this: torch.fx's takes its placeholders positionally,
    and torch.export's flattens (args, kwargs) leaves in the same order.
    """
    params = inspect.signature(g.gm.forward).parameters
    kwargs = {k: v for k, v in g.kwargs.items() if k in params}
    bound = inspect.signature(g.gm.forward).bind(*inputs, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args) + tuple(bound.kwargs.values())


def _clone(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(x.requires_grad)


class _ValueRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, values: Values) -> None:
        super().__init__(gm)
        self.values = values

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op != "get_attr":  # parameters are read from the model, never stored twice
            # Clone: a later in-place op (ReLU(inplace=True)) must not change what we recorded.
            self.values.value[n.name] = tree_map_only(torch.Tensor, _clone, result)
        return result


def record_values(gm: fx.GraphModule, args: Sequence[Any]) -> Values:
    """Run ``gm`` once (with autograd on, in train mode, as in training) and keep every node's
    value."""
    values = Values()
    mode = gm.training
    try:
        gm.training = True  # the graph's own flag ([Note: train and eval in one graph])
        with torch.enable_grad():
            _ValueRecorder(gm, values).run(*args)
    finally:
        gm.training = mode
    return values


def _layer_module(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> LayerCall:
    members = set(nodes)
    body = [n for n in nodes if n.op != "get_attr"]
    cut = GraphCut(grow_inputs=True)
    for n in body:  # placeholders first, in order of first use: a stable signature
        for i in n.all_input_nodes:
            if i not in members and i.op != "get_attr":
                cut.lookup(i)
    cut.copy(body)
    outputs = [n for n in body if any(u not in members for u in n.users)]
    module = cut.module(gm, tuple(outputs), "Layer_" + re.sub(r"\W", "_", name))
    module.training = True  # layers are measured as in training (modes.py reads this flag)
    return LayerCall(name, module, [n.name for n in cut.inputs], [n.name for n in outputs])


def layer_calls(g: LayerGraph) -> list[LayerCall]:
    """One :class:`LayerCall` per layer of ``g``, in layer order."""
    members: dict[str, list[fx.Node]] = {name: [] for name in g.layers}
    for node in g.gm.graph.nodes:
        layer = g.node_layer.get(node.name)
        if layer is not None:
            members[layer].append(node)
    return [_layer_module(g.gm, members[name], name) for name in g.layers]
