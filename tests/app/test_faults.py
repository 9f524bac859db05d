"""AUTOPIPE_FAULT (autopipe/app/faults.py): which faults a rank acts on, and each only once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.app.faults import ENV, Fault, Faults
from autopipe.errors import BuildError


def test_a_fault_fires_at_the_first_forward_of_its_step_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fired: list[Fault] = []
    monkeypatch.setattr(Fault, "fire", lambda self: fired.append(self))
    monkeypatch.setenv(ENV, "rank=1,step=3,signal=STOP;rank=0,step=3;rank=1,step=3,attempt=1")
    faults = Faults.from_env(rank=1, attempt=0)
    assert faults.faults == [Fault(rank=1, step=3, signal="STOP")]
    stages = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with faults.during_step(2, stages):
        stages[0](torch.zeros(1, 2))
    assert fired == []
    with faults.during_step(3, stages):  # a stopped rank, continued, runs its other micro-batches
        for _ in range(3):
            stages[1](stages[0](torch.zeros(1, 2)))
    assert fired == [Fault(rank=1, step=3, signal="STOP")]
    stages[0](torch.zeros(1, 2))  # the hooks are gone after the step
    assert len(fired) == 1


@pytest.mark.parametrize("text", ["rank=1", "rank=1,step=x", "rank=1,step=3,signal=TERM", "rank=1,step=3,when=load",
                                  "rank=1,step=3,color=red"])
def test_a_malformed_fault_is_one_line_naming_the_variable(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, text)
    with pytest.raises(BuildError, match=rf"^{ENV}=.*: each fault is rank=R,step=S"):
        Faults.from_env(rank=1, attempt=0)
