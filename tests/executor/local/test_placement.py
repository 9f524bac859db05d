"""executor.local.placement: device checks and parameters tied across devices."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from executor import GPipe
from executor.errors import PlacementError
from tests.executor.local.test_gpipe import Steps, Tied, _run, _tied_stages


def test_module_shared_across_devices_is_refused() -> None:
    with pytest.raises(
        PlacementError, match=r"module 'a' is used by stage 0 \(cpu\) and stage 1 \(meta\)"
    ):
        GPipe(_tied_stages(Tied()), ["cpu", "meta"], chunks=2)


class TiedEnds(nn.Module):
    """Embedding-and-head style tie: two modules, one Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(torch.tanh(self.mid(self.emb(x))))
        return out


def test_parameter_tied_across_devices_is_fetched_not_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No second device here: make the runtime treat the two CPU stages as different devices,
    # which exercises the same code path as cuda:0 / cuda:1 ([Note: ties across devices]).
    monkeypatch.setattr("executor.local.placement._same_device", lambda a, b: False)
    model = TiedEnds()
    ref = copy.deepcopy(model)
    stages = [
        Steps(model, ["emb", "mid"], [lambda m, x: torch.tanh(m.mid(m.emb(x)))]),
        Steps(model, ["head"], [lambda m, x: m.head(x)]),
    ]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=2, recompute="always")
    weight = model.emb.weight
    head = pipe.stages[1].head
    assert "weight" not in head._parameters  # only the first stage holds it
    assert model.head.weight is weight and head.bias is model.head.bias  # user model intact
    assert sum(p is weight for p in pipe.parameters()) == 1
    _run(pipe, ref, torch.randn(4, 4))
    assert head.weight is not weight  # a fetched copy, refreshed every forward
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt.step()
    before = head.weight.detach().clone()
    pipe(torch.randn(4, 4))
    torch.testing.assert_close(head.weight, weight)  # the copy follows the update
    assert not torch.equal(before, head.weight)
