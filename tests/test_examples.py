from __future__ import annotations

import pytest
import torch

from autopipe import AutopipeError
from autopipe.examples import EXAMPLES, get_example


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_one_step(name: str) -> None:
    ex = get_example(name, batch_size=3)
    assert ex.name == name
    assert all(x.shape[0] == 3 for x in ex.inputs) and ex.target.shape[0] == 3
    loss = ex.loss_fn(ex.model(*ex.inputs), ex.target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in ex.model.parameters())


def test_examples_are_seeded_and_do_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = get_example("gpt", 2), get_example("gpt", 2)
    assert torch.rand(1) == before  # get_example forks the RNG
    assert torch.equal(a.inputs[0], b.inputs[0])
    assert torch.equal(a.model.tok.weight, b.model.tok.weight)
    assert not torch.equal(a.model.tok.weight, get_example("gpt", 2, seed=1).model.tok.weight)


def test_gpt_head_is_tied_and_mlp_is_uneven() -> None:
    gpt = get_example("gpt", 2).model
    assert gpt.head.weight is gpt.tok.weight
    linears = [m for m in get_example("mlp", 2).model.modules() if isinstance(m, torch.nn.Linear)]
    flops = [m.in_features * m.out_features for m in linears]
    assert max(flops) / min(flops) >= 16


@pytest.mark.parametrize(
    "name,batch,match", [("resnet", 2, "unknown example 'resnet'"), ("mlp", 0, "batch_size")]
)
def test_bad_arguments(name: str, batch: int, match: str) -> None:
    with pytest.raises(AutopipeError, match=match):
        get_example(name, batch)
