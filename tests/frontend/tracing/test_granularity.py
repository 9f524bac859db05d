"""[Note: automatic granularity]: layers far finer than their modules are grouped back to them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autopipe
from autopipe.examples import get_example
from autopipe.frontend.tracing.granularity import MAX_LAYERS_PER_MODULE
from tests.frontend.many_layers import FineBlock, Scan


def _covered(g: autopipe.LayerGraph) -> dict[str, list[str]]:
    return {n: sorted(m for m, layer in g.node_layer.items() if layer == n) for n in g.layers}


def test_a_block_of_many_ops_is_one_layer_and_its_neighbours_stay() -> None:
    model = nn.Sequential(nn.Linear(8, 8), FineBlock(), nn.Linear(8, 8))
    g = autopipe.trace(model, (torch.randn(2, 8),))
    assert g.layers == ["0", "1", "2"]
    assert g.grouped == {"1": MAX_LAYERS_PER_MODULE + 2}
    assert (g.layer("1")["kind"], g.layer("1")["module_type"]) == ("module", "FineBlock")
    fine = autopipe.trace(model, (torch.randn(2, 8),), leaf_modules=[])  # chosen: as traced
    assert len(fine.layers) == MAX_LAYERS_PER_MODULE + 4 and fine.grouped == {}
    assert set(g.node_layer) == set(fine.node_layer)  # the same nodes, fewer names


def test_a_long_loop_in_the_model_own_forward_is_cut_into_runs() -> None:
    model = Scan(steps=40)
    g = autopipe.trace(model, (torch.randn(2, 40, 8),))
    fine = autopipe.trace(model, (torch.randn(2, 40, 8),), max_depth=1)
    assert len(fine.layers) == 4 * 40 + 4 and fine.grouped == {}
    assert sum(g.grouped.values()) + len(g.layers) - len(g.grouped) == len(fine.layers)
    assert len(g.layers) == 2 + -(-(len(fine.layers) - 2) // MAX_LAYERS_PER_MODULE)
    assert max(g.grouped.values()) == MAX_LAYERS_PER_MODULE
    # every merged layer is consecutive traced layers: its nodes are the union of theirs
    fine_of = _covered(fine)
    order = fine.layers
    for name, nodes in _covered(g).items():
        start = order.index(name)
        span = order[start:start + g.grouped.get(name, 1)]
        assert nodes == sorted(n for f in span for n in fine_of[f])


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "unet"])
def test_the_bundled_examples_are_not_grouped(name: str) -> None:
    example = get_example(name, batch_size=2)
    g = autopipe.trace(example.model, example.inputs)
    assert g.grouped == {} and g.layers == autopipe.trace(example.model, example.inputs, leaf_modules=[]).layers


def test_a_grouped_pipeline_computes_the_plain_model_gradients() -> None:
    torch.manual_seed(0)
    model, x = Scan(steps=40), torch.randn(4, 40, 8)
    plain = copy.deepcopy(model)
    g = autopipe.trace(model, (x[:2],))
    prof = autopipe.profile(model, (x,), chunks=2, graph=g, repeats=1, warmup=0)
    pipe = autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, recompute="always",
                             graph=g, profile=prof)
    assert len(pipe.plan.stages) == 2 and sum(len(s) for s in pipe.plan.stages) == len(g.layers) < 4 * 40
    loss = pipe(x).square().mean()
    loss.backward()
    expected = plain(x).square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
