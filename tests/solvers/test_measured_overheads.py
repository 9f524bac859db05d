"""[Note: measured overheads] in the cost model: the stage call's fixed cost and the recompute
ratio from the profile's metadata, through every formula user; absent = today's model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    StageCost,
    layer_work,
    lower_bound,
    recompute_ms,
    stage_costs,
    stage_fixed_ms,
    stage_time,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain

OVERHEADS = {"stage_call_fwd_ms": 0.3, "stage_call_bwd_ms": 0.2, "recompute_ratio": 1.5,
             "recompute_call_ms": 0.4}


def _with(profile: Profile, meta: dict[str, object]) -> Profile:
    return Profile(profile.df, profile.edges, {**profile.meta, **meta})


def test_formulas_default_to_todays_model() -> None:
    assert recompute_ms(4.0, 1, 2) == 2.0
    assert recompute_ms(4.0, 1, 2, 1.5) == 3.0
    assert recompute_ms(4.0, 1, 2, 1.5, fixed_ms=0.4) == pytest.approx(3.2)  # per stage, not layer
    assert stage_fixed_ms(0.5, 0.4, 3, 4) == pytest.approx(0.8)
    assert layer_work(4.0, 8.0, 2, 2, 1.5) == 4.0 + 6.0 + 8.0
    assert stage_time(10.0, 2.0, 0, 0, 0.0) == 5.0
    assert stage_time(10.0, 2.0, 0, 0, 0.0, call_ms=0.5) == 5.5  # host time: not scaled
    assert lower_bound(np.full(2, 12.0), [1.0, 1.0], 0.5) == 12.5


def test_a_profile_without_them_reads_as_before() -> None:
    prof = random_chain(12, 3)
    costs = LayerCosts.from_profile(prof)
    assert (costs.call_fwd_ms, costs.call_bwd_ms, costs.recompute_ratio) == (0.0, 0.0, 1.0)
    with pytest.raises(ProfileError, match=r"^meta\['stage_call_fwd_ms'\] must be a finite number >= 0, got 'x'"):
        _with(prof, {"stage_call_fwd_ms": "x"})  # an old profile's value, read: not a silent default
    with pytest.raises(ProfileError, match=r"^meta\['recompute_ratio'\] must be a finite number >= 0, got -1"):
        _with(prof, {"recompute_ratio": -1})


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_stage_costs_add_the_call_and_scale_the_recompute(recompute: str) -> None:
    prof = random_chain(12, 3)
    devices = [DeviceSpec("a"), DeviceSpec("b", speed=2.0)]
    options = CostOptions(chunks=4, recompute=recompute, bandwidth=None)
    split = [0] * 6 + [1] * 6
    before = stage_costs(LayerCosts.from_profile(prof), split, devices, options)
    after = stage_costs(LayerCosts.from_profile(_with(prof, OVERHEADS)), split, devices, options)
    share = {"never": 0, "except_last": 3, "always": 4}[recompute] / 4  # R / M
    for b, a in zip(before, after, strict=True):
        assert a.recompute_ms == pytest.approx(1.5 * b.recompute_ms + 0.4 * share)
        assert a.time_ms == pytest.approx(b.time_ms + 0.5 * b.recompute_ms + 0.4 * share + 0.5)


@pytest.mark.parametrize("method", ["dp", "ilp"])
@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
def test_solvers_plan_and_simulator_agree_on_the_new_times(method: str, recompute: str) -> None:
    prof = _with(random_chain(10, 1), OVERHEADS)
    plan = partition(prof, devices=["cpu", "cpu"], chunks=4, recompute=recompute,
                     method=method, bandwidth=None)
    costs = LayerCosts.from_profile(prof)
    where = {n: s for s, names in enumerate(plan.stages) for n in names}
    expect = stage_costs(costs, [where[n] for n in prof.layers], plan.devices,
                         CostOptions(chunks=4, recompute=recompute, bandwidth=None))
    assert plan.stage_times == pytest.approx([c.time_ms for c in expect])
    # one shared device serialises the stages: the iteration is M x the sum of stage times
    assert plan.iteration_time == pytest.approx(4 * sum(plan.stage_times))
    assert plan.lower_bound <= plan.bottleneck + 1e-9
    # the DP is exact over the order: no contiguous split beats it
    if method == "dp":
        for cut in range(1, 10):
            alt = Plan.from_stages(prof, [prof.layers[:cut], prof.layers[cut:]],
                                   devices=["cpu", "cpu"], chunks=4, recompute=recompute,
                                   bandwidth=None)
            assert plan.bottleneck <= alt.bottleneck + 1e-9


def test_old_plan_breakdowns_load() -> None:
    fields = {f.name for f in dataclasses.fields(StageCost)} - {
        "call_fwd_ms", "call_bwd_ms", "recompute_ratio", "bwd_weight_ms"}
    old = {name: 1 for name in fields}
    cost = StageCost(**old)  # type: ignore[arg-type]
    assert cost.time_ms == 4 and cost.recompute_ratio == 1.0
