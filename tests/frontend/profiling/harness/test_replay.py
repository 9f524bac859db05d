from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from autopipe.examples import get_example
from autopipe.frontend.profiling.harness.replay import graph_args, layer_calls, record_values
from autopipe.frontend.tracing.graph import trace
from tests.models import MultiIO, Skip


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "unet"])
def test_layers_replayed_in_order_reproduce_the_model(name: str) -> None:
    ex = get_example(name, batch_size=2)
    g = trace(ex.model, ex.inputs)
    args = graph_args(g, ex.inputs)
    values = record_values(g.gm, args)
    # start from the recorded graph inputs only; every other value comes from a replayed layer
    env = {n.name: values.value[n.name] for n in g.gm.graph.nodes if n.op == "placeholder"}
    for call in layer_calls(g):
        outs = call.module(*[env[n] for n in call.inputs])
        assert len(outs) == len(call.outputs)
        env.update(zip(call.outputs, outs, strict=True))
    (final,) = [n for n in g.gm.graph.nodes if n.op == "output"][0].all_input_nodes
    with torch.no_grad():
        want = ex.model(*ex.inputs)
    torch.testing.assert_close(env[final.name], want)
    # recorded values are clones: the in-place ReLUs of the cnn did not change them afterwards
    torch.testing.assert_close(values.value[final.name], want)


def test_layer_modules_share_parameters_and_read_skips() -> None:
    model = Skip()
    g = trace(model, (torch.randn(3, 8),))
    calls = {c.name: c for c in layer_calls(g)}
    assert calls["a"].module.get_submodule("a").weight is model.a.weight
    assert calls["add"].inputs == ["c", "a"]  # the skip from a arrives as an input of the add
    assert calls["a"].outputs == ["a"] and calls["d"].outputs == ["d"]


def test_recorded_values_keep_requires_grad_and_export_calling_convention() -> None:
    model = MultiIO()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    g = trace(model, (x, y))
    values = record_values(g.gm, graph_args(g, (x, y)))
    placeholders = [n.name for n in g.gm.graph.nodes if n.op == "placeholder"]
    assert not any(t.requires_grad for n in placeholders for t in tree_leaves(values.value[n])
                   if isinstance(t, torch.Tensor))
    assert values.value["x_proj"].requires_grad and values.value["x_proj"].grad_fn is None
