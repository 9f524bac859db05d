"""Profiling under a precision ([Note: profiling under a precision]): every forward under autocast,
the precision's bytes, and ActivationMeter agreeing with the prediction under bf16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autopipe
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.frontend.building.stages import build
from autopipe.frontend.profiling.harness.inputs import micro_batch
from autopipe.frontend.profiling.harness.under_autocast import AutocastStage
from executor.activation_meter import ActivationMeter
from executor.local.gpipe import GPipe

ROWS, WIDTH, CHUNKS = 256, 16, 2  # many rows, small weights: activations dominate the bytes
SEEN: list[tuple[bool, torch.dtype]] = []  # (autocast on, the input's dtype) of every real call


class Seen(nn.Module):
    """A leaf layer that records how it was called (real tensors only, not the tracer's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor or isinstance(x, nn.Parameter):
            SEEN.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return torch.relu(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), Seen(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH))


def _profile(model: nn.Module, x: torch.Tensor, precision: str) -> Profile:
    return autopipe.profile(model, (x,), chunks=CHUNKS, repeats=1, warmup=0, progress=False,
                            precision=precision, leaf_modules=[Seen])


@pytest.fixture(scope="module")
def profiles() -> tuple[nn.Module, torch.Tensor, Profile, Profile]:
    model, x = _model(), torch.randn(ROWS, WIDTH)
    fp32 = _profile(model, x, "fp32")
    SEEN.clear()
    bf16 = _profile(model, x, "bf16")
    return model, x, fp32, bf16


def test_the_profile_records_its_precision(profiles: Any, tmp_path: Any) -> None:
    _, _, fp32, bf16 = profiles
    assert fp32.meta["precision"] == "fp32" and bf16.meta["precision"] == "bf16"
    bf16.save(tmp_path / "p.csv")
    assert Profile.load(tmp_path / "p.csv").meta["precision"] == "bf16"
    assert autopipe.partition(bf16, devices=["cpu", "cpu"], chunks=CHUNKS).precision == "bf16"


def test_every_measured_forward_ran_under_autocast(profiles: Any) -> None:
    # layer alone (probe, timing, output bytes), the whole graph, GPipe never/always, the stamps
    assert len(SEEN) >= 5
    assert set(SEEN) == {(True, torch.bfloat16)}  # the Linear before it computed in bf16


def test_bytes_are_the_precisions(profiles: Any) -> None:
    _, _, fp32, bf16 = profiles
    micro = ROWS // CHUNKS
    weight = WIDTH * WIDTH * 2  # the bf16 copy a Linear saves when its input needs a gradient
    low, high = fp32.df.set_index("layer"), bf16.df.set_index("layer")
    assert (high["output_bytes"] * 2 == low["output_bytes"]).all()
    assert [b for *_, b in bf16.edges] == [b // 2 for *_, b in fp32.edges]
    first, *later = list(high.index[high["module_type"] == "Linear"])
    # the first Linear saves its input cast to bf16 (not the caller's batch: a copy of its own)
    assert high.loc[first, "saved_bytes"] == micro * WIDTH * 2 and high.loc[first, "saved_shared_bytes"] == 0
    for name in later:  # half the activations, plus the weight copy autocast made
        assert high.loc[name, "saved_bytes"] == low.loc[name, "saved_bytes"] // 2 + weight
    assert 0.5 <= high["saved_bytes"].sum() / low["saved_bytes"].sum() <= 0.55  # roughly half


def test_an_unknown_precision_is_refused_in_one_line() -> None:
    with pytest.raises(ProfileError, match="precision='int8' is unknown; use one of fp32, bf16, fp16"):
        autopipe.profile(nn.Linear(2, 2), (torch.randn(2, 2),), precision="int8")


@pytest.mark.parametrize("mode", ["never", "always"])
def test_activation_meter_agrees_with_the_bf16_prediction(profiles: Any, mode: str) -> None:
    model, x, _, bf16 = profiles
    plan = autopipe.Plan.from_stages(bf16, [bf16.layers[:2], bf16.layers[2:]], devices=["cpu", "cpu"],
                                     chunks=CHUNKS, recompute=mode)
    graph = autopipe.trace(model, micro_batch((x,), CHUNKS)[0], leaf_modules=[Seen])
    stages = [AutocastStage(s, "bf16", torch.device("cpu")) for s in build(model, plan, graph)]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=CHUNKS, recompute=mode)
    meter = ActivationMeter(pipe.stages, inputs=(x,))
    with meter:
        out = pipe(x)
        with meter.outside():
            loss = out.float().square().mean()
        loss.backward()
    # as in fp32 (tests/test_benchmark_memory_vs_prediction.py): what a recomputing stage's
    # layers save of its input beyond its first layer's is counted twice; the rest within 10%
    copies = [max(m - b.input_saved_bytes, 0) if mode == "always" else 0
              for m, b in zip(meter.input_saves, plan.breakdown, strict=True)]
    for predicted, measured, copy in zip(plan.breakdown, meter.peaks, copies, strict=True):
        assert measured > 0 and 0.9 <= measured / (predicted.activation_bytes - copy) <= 1.1, (mode, meter.peaks)
