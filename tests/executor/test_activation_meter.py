"""ActivationMeter: the bytes each stage keeps for backward, exactly ([Note: counting activations])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.activation_meter import ActivationMeter
from executor.local.gpipe import GPipe

F32 = 4


def _run(mode: str) -> ActivationMeter:
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 8), nn.ReLU())]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=2, recompute=mode)
    x = torch.randn(4, 8)
    meter = ActivationMeter(pipe.stages, inputs=(x,))
    with meter:
        out = pipe(x)
        with meter.outside():  # the loss is not a stage's
            loss = out.square().mean()
        loss.backward()
    assert meter.live == [0, 0]  # everything given back once backward freed it
    return meter


@pytest.mark.parametrize(("mode", "peaks"), [
    # stage 0 keeps its ReLU output (2 rows x 16) per micro-batch (x is the caller's: not
    # counted); stage 1 its input (the same 2 x 16) and its ReLU output (2 x 8)
    ("never", [2 * (2 * 16), 2 * (2 * 16 + 2 * 8)]),
    # checkpointed: a stage holds its inputs, and one micro-batch's activations while recomputing
    ("always", [2 * 16, 2 * (2 * 16) + 2 * 8]),
    # micro-batch 1 is not checkpointed and back-propagates first (executor.GPipe drains in
    # reverse): stage 0 never holds more than one micro-batch's ReLU output
    ("except_last", [2 * 16, 2 * 16 + (2 * 16 + 2 * 8)]),
])
def test_exact_bytes_per_stage(mode: str, peaks: list[int]) -> None:
    assert _run(mode).peaks == [p * F32 for p in peaks]


def test_without_outside_the_loss_counts_on_the_last_stage() -> None:
    stages = [nn.Linear(8, 8), nn.Linear(8, 8)]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=1, recompute="never")
    x = torch.randn(2, 8)
    meter = ActivationMeter(pipe.stages, inputs=(x,))
    with meter:
        pipe(x).square().sum().backward()  # square saves its input: charged to stage 1
    # stage 0's Linear saves only x (the caller's); stage 1's its input, then the loss's square
    assert meter.peaks == [0, 2 * (2 * 8 * F32)]
