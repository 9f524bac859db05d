"""distributed_pipeline(example_target=): rank 0 plans with the loss's own time, measured by
calling the loss on the example's first micro-batch ([Note: the loss in the last stage])."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopipe.assemble.ranks import distributed_pipeline
from tests.assemble.test_ranks import _ok, spawn

CHUNKS = 2


def _calls_before_the_first_step(rank: int, with_target: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    rows: list[int] = []

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        rows.append(out.shape[0])
        return F.cross_entropy(out, target)

    pipe = distributed_pipeline(model, (x,), loss_fn=loss_fn, chunks=CHUNKS, method="exact",
                                example_target=y if with_target else None, timeout=30)
    planned = list(rows)
    loss = pipe.step(x, target=y)
    return {"planned": planned, "stepped": rows[len(planned):], "loss": loss}


def test_rank0_times_the_loss_on_the_example_target_only_when_given() -> None:
    timed, untimed = (_ok(spawn(_calls_before_the_first_step, w)) for w in (True, False))
    assert timed[0]["planned"] and set(timed[0]["planned"]) == {8 // CHUNKS}  # one micro-batch
    assert timed[1]["planned"] == [] and untimed[0]["planned"] == untimed[1]["planned"] == []
    for values in (timed, untimed):  # the step itself: the last rank, once per micro-batch
        assert values[0]["stepped"] == [] and values[1]["stepped"] == [8 // CHUNKS] * CHUNKS
        assert values[0]["loss"] is None and torch.isfinite(values[1]["loss"])
