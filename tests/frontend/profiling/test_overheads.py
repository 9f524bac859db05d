"""[Note: measured overheads]: the profiler measures a stage call's fixed cost and the recompute
ratio in both profile modes, and they reach the plan's stage times."""

from __future__ import annotations

import math

import pytest
import torch

import autopipe
from autopipe.core.cost import LayerCosts
from autopipe.frontend.profiling.overheads import RATIO_RANGE, stage_call_ms
from autopipe.frontend.profiling.timing import CpuTimer
from tests.models import Chain

KEYS = ("stage_call_fwd_ms", "stage_call_bwd_ms", "recompute_ratio")


@pytest.mark.parametrize("mode", ["whole", "layers"])
def test_profile_records_the_overheads_in_both_modes(mode: str) -> None:
    model, x = Chain((64, 256, 256, 64)), torch.randn(32, 64)
    prof = autopipe.profile(model, (x,), chunks=2, repeats=2, warmup=1, mode=mode)
    for key in KEYS:
        assert math.isfinite(prof.meta[key]) and prof.meta[key] >= 0
    assert prof.meta["stage_call_fwd_ms"] > 0  # an empty pipeline still takes time
    low, high = RATIO_RANGE
    assert low <= prof.meta["recompute_ratio"] <= high
    costs = LayerCosts.from_profile(prof)
    assert costs.call_ms() == pytest.approx(prof.meta["stage_call_fwd_ms"] + prof.meta["stage_call_bwd_ms"])
    plan = autopipe.partition(prof, stages=2, chunks=2, checkpoint="never", bandwidth=None)
    layers = sum(prof.df.loc[prof.df["layer"].isin(s), ["fwd_ms", "bwd_ms"]].to_numpy().sum()
                 for s in plan.stages[:1])
    assert plan.stage_times[0] == pytest.approx(layers + costs.call_ms(), abs=1e-6)


def test_stage_call_is_per_stage_and_micro_batch() -> None:
    fwd, bwd, recompute = stage_call_ms(CpuTimer(), torch.device("cpu"), chunks=3)
    assert fwd > 0 and bwd >= 0 and recompute > 0  # checkpointing adds autograd nodes, RNG state
