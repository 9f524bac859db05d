"""[Note: transfer cost] with a measured link: latency + bytes / bandwidth per crossing, read
from the profile's metadata (autopipe profile --comm); a profile without it plans as before."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    crossing_ms,
    receive_ms,
    stage_costs,
    transfer_ms,
)
from autopipe.core.cost_options import CostOptions
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
    # the receiver pays its share of the bytes again: 0.5 x (1000 + 3000) x 1e-5 on top
    assert receive_ms(4000, 1e-5, 0.5) == pytest.approx(0.02) and receive_ms(4000, 1e-5) == 0.0
    assert transfer_ms(1000, 3000, 1e-5, 0.2, receive_share=0.5) == pytest.approx(0.04 + 0.4 + 0.02)


def test_the_measured_link_flows_into_plans_and_the_simulator() -> None:
    base = random_chain(10, 2)
    prof = _with(base, COMM)
    costs = LayerCosts.from_profile(prof)
    assert (costs.comm_latency_ms, costs.comm_bandwidth) == (0.2, 1e8)
    devices = [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")]
    options = CostOptions(chunks=4, recompute="never", bandwidth=1e8)
    split = [0] * 3 + [1] * 4 + [2] * 3
    before = stage_costs(LayerCosts.from_profile(base), split, devices, options)
    after = stage_costs(costs, split, devices, options)
    assert [a.transfer_ms - b.transfer_ms for a, b in zip(after, before, strict=True)] == \
        pytest.approx([0.2, 0.4, 0.2])  # one message per cut a stage sends on
    plan = partition(prof, stages=3, chunks=4, recompute="never", method="dp")
    assert plan.bandwidth == 1e8  # not given: the measured one
    assert partition(base, stages=3, chunks=4, recompute="never").bandwidth == 10e9
    same = Plan.from_stages(prof, plan.stages, devices=plan.devices, chunks=4, recompute="never",
                            bandwidth=1e8)
    assert same.stage_times == pytest.approx(plan.stage_times)
    assert simulate(plan, prof).iteration_time == pytest.approx(plan.iteration_time)
    free = Plan.from_stages(prof, plan.stages, devices=plan.devices, chunks=4, recompute="never",
                            bandwidth=None)
    assert all(b.transfer_ms == 0 for b in free.breakdown)


@pytest.mark.parametrize("method", ["dp", "ilp"])
def test_the_solvers_charge_what_the_plan_reports(method: str) -> None:
    prof = _with(random_chain(9, 5), {**COMM, "comm_receive_share": 0.7})  # the receiver pays too
    plan = partition(prof, stages=3, chunks=4, recompute="except_last", method=method)
    assert plan.bottleneck == pytest.approx(max(plan.stage_times))
    if method == "dp":  # exact over the order: no other 3-way split beats it under the same model
        layers = prof.layers
        for i in range(1, 8):
            for j in range(i + 1, 9):
                alt = Plan.from_stages(prof, [layers[:i], layers[i:j], layers[j:]], devices=plan.devices,
                                       chunks=4, recompute="except_last", bandwidth=1e8)
                assert plan.bottleneck <= alt.bottleneck + 1e-9


def test_the_receiver_pays_its_share_right_before_the_work_that_reads_it() -> None:
    # 2 stages, 1 micro-batch, 1000 bytes each way at 1e-3 ms/byte (1 ms), latency 0, share 0.5
    prof = _with(random_chain(4, 3), {"comm_latency_ms": 0.0, "comm_bandwidth": 1e6, "comm_receive_share": 0.5})
    costs = LayerCosts.from_profile(prof)
    assert costs.comm_receive_share == 0.5
    plan = Plan.from_stages(prof, [prof.layers[:2], prof.layers[2:]], devices=["a", "b"], chunks=1,
                            recompute="never", bandwidth=1e6)
    first, second = plan.breakdown
    nbytes = first.output_bytes
    assert nbytes == second.input_bytes > 0 and first.receive_share == second.receive_share == 0.5
    crossing = nbytes * 1e-3
    assert first.transfer_ms == pytest.approx(1.5 * crossing) == second.transfer_ms
    sim = simulate(plan, prof)
    spans = {(e.stage, e.phase): (e.start_ms, e.end_ms) for e in sim.timeline if e.phase != "transfer"}
    receives = sorted((e.stage, e.start_ms, e.end_ms) for e in sim.timeline if e.phase == "transfer"
                      and e.duration_ms == pytest.approx(0.5 * crossing))
    # stage 1 receives the activation after stage 0's send, then runs its forward; stage 0
    # receives the gradient after stage 1's send, then runs its backward
    assert [s for s, *_ in receives] == [0, 1]
    assert receives[1][1] == pytest.approx(spans[0, "forward"][1] + crossing)
    assert spans[1, "forward"][0] == pytest.approx(receives[1][2])
    assert receives[0][1] == pytest.approx(spans[1, "backward"][1] + crossing)
    assert spans[0, "backward"][0] == pytest.approx(receives[0][2])
    assert sim.iteration_time == pytest.approx(spans[0, "backward"][1])
    # the DP prices the same stages as the plan
    best = partition(prof, stages=2, chunks=1, recompute="never", method="dp")
    assert best.bottleneck == pytest.approx(max(best.stage_times))
