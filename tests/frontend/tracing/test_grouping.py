from __future__ import annotations

import operator

import torch
from torch import fx

from autopipe.frontend.tracing.capture import capture
from autopipe.frontend.tracing.grouping import group_layers, is_cheap, value_bytes
from tests.models import MultiIO


def test_value_bytes_walks_nested_values() -> None:
    t = torch.zeros(2, 3)
    assert value_bytes(t) == 24
    assert value_bytes((t, {"a": t.double()}, 3, None)) == 24 + 48
    assert value_bytes(7) == 0


def test_cheap_ops_are_views_and_shape_arithmetic() -> None:
    cap = capture(MultiIO(), (torch.randn(4, 8), torch.randn(4, 8)))
    kinds = {n.name: is_cheap(n) for n in cap.gm.graph.nodes if n.op != "placeholder"}
    assert kinds["size"] and kinds["reshape"]  # x.size(1) and h.reshape(-1, n)
    assert not kinds["x_proj"] and not kinds["add"]
    graph = fx.Graph()
    x = graph.placeholder("x")
    getitem = graph.call_function(operator.getitem, (x, 0))
    assert is_cheap(getitem)


def test_layers_are_intervals_of_the_graph() -> None:
    cap = capture(MultiIO(), (torch.randn(4, 8), torch.randn(4, 8)))
    layers, node_layer = group_layers(cap)
    order = [n.name for n in cap.gm.graph.nodes if n.name in node_layer]
    seen: list[str] = []
    for name in order:  # each layer's nodes are contiguous in graph order
        layer = node_layer[name]
        if not seen or seen[-1] != layer:
            assert layer not in seen, f"layer {layer} is split"
            seen.append(layer)
    assert [name for name, _ in layers] == seen == ["x_proj", "y_proj", "add", "out"]
    # the shape computation x.size(1) and the reshape joined a neighbouring layer
    assert node_layer["size"] in {"x_proj", "y_proj", "add"}
    assert node_layer["reshape"] == "add"
