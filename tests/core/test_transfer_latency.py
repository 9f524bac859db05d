"""[Note: transfer cost] with a measured link: latency + bytes / bandwidth per crossing, read
from the profile's metadata (autopipe profile --comm); a profile without it plans as before."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.core.cost import (
    CostOptions,
    DeviceSpec,
    LayerCosts,
    crossing_ms,
    stage_costs,
    transfer_ms,
)
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain

COMM = {"comm_latency_ms": 0.2, "comm_bandwidth": 1e8}  # 0.01 ms per KB


def _with(profile: Profile, meta: dict[str, object]) -> Profile:
    return Profile(profile.df, profile.edges, {**profile.meta, **meta})


def test_a_crossing_pays_the_latency_once_and_only_when_bytes_cross() -> None:
    assert crossing_ms(1000, 1e-5, 0.2) == pytest.approx(0.21)
    assert crossing_ms(0, 1e-5, 0.2) == 0.0  # a first stage's input, a last stage's output
    assert crossing_ms(1000, 0.0, 0.2) == 0.0  # bandwidth None / 0: free, latency included
    assert transfer_ms(1000, 3000, 1e-5) == pytest.approx(0.04)  # no latency: as before
    assert transfer_ms(np.array([0.0, 1000.0]), 1000, 1e-5, 0.2) == pytest.approx([0.21, 0.42])


def test_the_measured_link_flows_into_plans_and_the_simulator() -> None:
    base = random_chain(10, 2)
    prof = _with(base, COMM)
    costs = LayerCosts.from_profile(prof)
    assert (costs.comm_latency_ms, costs.comm_bandwidth) == (0.2, 1e8)
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    options = CostOptions(chunks=4, checkpoint="never", bandwidth=1e8)
    split = [0] * 3 + [1] * 4 + [2] * 3
    before = stage_costs(LayerCosts.from_profile(base), split, devices, options)
    after = stage_costs(costs, split, devices, options)
    assert [a.transfer_ms - b.transfer_ms for a, b in zip(after, before, strict=True)] == \
        pytest.approx([0.2, 0.4, 0.2])  # one message per cut a stage sends on
    plan = partition(prof, stages=3, chunks=4, checkpoint="never", method="dp")
    assert plan.bandwidth == 1e8  # not given: the measured one
    assert partition(base, stages=3, chunks=4, checkpoint="never").bandwidth == 10e9
    same = Plan.from_stages(prof, plan.stages, devices=plan.devices, chunks=4, checkpoint="never",
                            bandwidth=1e8)
    assert same.stage_times == pytest.approx(plan.stage_times)
    assert simulate(plan, prof).iteration_time == pytest.approx(plan.iteration_time)
    free = Plan.from_stages(prof, plan.stages, devices=plan.devices, chunks=4, checkpoint="never",
                            bandwidth=None)
    assert all(b.transfer_ms == 0 for b in free.breakdown)


@pytest.mark.parametrize("method", ["dp", "ilp"])
def test_the_solvers_charge_what_the_plan_reports(method: str) -> None:
    prof = _with(random_chain(9, 5), COMM)
    plan = partition(prof, stages=3, chunks=4, checkpoint="except_last", method=method)
    assert plan.bottleneck == pytest.approx(max(plan.stage_times))
    if method == "dp":  # exact over the order: no other 3-way split beats it under the same model
        layers = prof.layers
        for i in range(1, 8):
            for j in range(i + 1, 9):
                alt = Plan.from_stages(prof, [layers[:i], layers[i:j], layers[j:]], devices=plan.devices,
                                       chunks=4, checkpoint="except_last", bandwidth=1e8)
                assert plan.bottleneck <= alt.bottleneck + 1e-9
