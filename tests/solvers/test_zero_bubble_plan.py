"""Planning the zero-bubble schedules: their layouts and counts, the split's memory in the DP and
the ILP, the automatic search among all six schedules, and a profile without the split."""

from __future__ import annotations

import re

import pytest

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.errors import PartitionError
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import solve_ilp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.stage_dp import budget_devices
from autopipe.solvers.synthetic import random_chain, transformer_dag
from executor.spec import ZERO_BUBBLE_SCHEDULES

AUTO = dict(stages="auto", chunks="auto", recompute="auto", schedule="auto", progress=False)


def _sized(prof: Profile, micro: int, batch: int) -> Profile:
    prof.meta.update(micro_batch_size=micro, batch_size=batch, chunks=batch // micro, device_type="cuda")
    return prof


def _fits(plan: Plan) -> bool:
    limits = {d.name: d.memory for d in plan.devices}
    return all(limits[n] is None or m <= limits[n] for n, m in plan.device_memory.items())


def test_stage_counts_lay_out_as_torch_places_them() -> None:
    prof = _sized(random_chain(12, 1, split=True), 2, 8)
    zbv = partition(prof, stages=4, chunks=4, schedule="zbv", progress=False)
    assert [d.name for d in zbv.devices] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]
    izb = partition(prof, stages=6, chunks=6, schedule="interleaved_zb", progress=False)
    assert [d.name for d in izb.devices] == ["cuda:0", "cuda:1", "cuda:2"] * 2
    with pytest.raises(PartitionError, match=r"^schedule='dualpipev' needs chunks >= stages \(4\), got chunks=2"):
        partition(prof, stages=4, chunks=2, schedule="dualpipev", progress=False)
    with pytest.raises(PartitionError, match=r"runs 2 stages on each rank: give an even stages \(not 3\)"):
        partition(prof, stages=3, chunks=4, schedule="zbv", progress=False)
    with pytest.raises(PartitionError, match=r"zbv runs stages r and 2W-1-r on rank r"):
        partition(prof, devices=["a", "b", "a", "b"], chunks=4, schedule="zbv", progress=False)
    # the ranks named once each, no stages: two stages each, in the V
    for devices in (2, ["cuda:0", "cuda:1"], [DeviceSpec("cuda:0", memory=2**40), DeviceSpec("cuda:1")]):
        v = partition(prof, devices=devices, chunks=4, schedule="dualpipev", progress=False)
        assert [d.name for d in v.devices] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0"], devices
        assert v.num_stages == 4 and v.devices[0].memory == v.devices[3].memory
    replicas = partition(prof, devices=4, chunks=4, schedule="zbv", data_parallel=2, progress=False)
    assert (replicas.num_stages, replicas.data_parallel) == (4, 2)
    searched = partition(prof, devices=2, chunks=4, recompute="auto", schedule="zbv", progress=False)
    assert [d.name for d in searched.devices] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]  # the search's own V
    with pytest.raises(PartitionError, match=r"zbv runs exactly 2 stages per rank, but 2 stages' devices"):
        partition(prof, stages=2, devices=2, chunks=4, schedule="zbv", progress=False)  # stages given: as given


def test_a_profile_without_the_split_says_profile_again() -> None:
    prof = _sized(random_chain(10, 2), 2, 8)
    for schedule in ZERO_BUBBLE_SCHEDULES:
        with pytest.raises(PartitionError, match=rf"^profile again: schedule='{schedule}' splits each backward"):
            partition(prof, stages=4, chunks=4, schedule=schedule, progress=False)
    plan = partition(prof, devices=4, **AUTO)  # type: ignore[arg-type]
    assert plan.schedule not in ZERO_BUBBLE_SCHEDULES
    assert set(plan.skipped_schedules) == set(ZERO_BUBBLE_SCHEDULES)
    text = plan.explain()
    assert "Not weighed: interleaved_zb (the profile has no split backward" in text and "profile again" in text


def test_the_split_memory_binds_in_the_dp_and_the_ilp() -> None:
    prof = random_chain(10, 5, split=True)
    costs = LayerCosts.from_profile(prof)
    free = partition(prof, devices=["a", "b", "b", "a"], chunks=4, recompute="never", schedule="zbv", progress=False)
    need = max(free.stage_memory)
    limit = int(need * 0.8)
    devices = [DeviceSpec(n, 2 * limit) for n in ("a", "b", "b", "a")]  # 1/2 of a rank each
    options = CostOptions(4, "never", schedule="zbv")
    budget = budget_devices(devices, "zbv")
    dp = solve_dp(costs, budget, options)
    for stage in stage_costs(costs, dp.assignment, devices, options):
        assert stage.memory_bytes <= limit and stage.weight_held_bytes > 0
    ilp = solve_ilp(costs, budget, options, warm_start=dp.assignment, time_limit=5)
    assert all(s.memory_bytes <= limit for s in stage_costs(costs, ilp.assignment, devices, options))
    assert ilp.objective <= dp.bottleneck * (1 + 1e-9)
    tight = [DeviceSpec(n, 2 * min(s.param_bytes for s in free.breakdown)) for n in ("a", "b", "b", "a")]
    with pytest.raises(PartitionError):
        solve_dp(costs, budget_devices(tight, "zbv"), options)


def test_auto_weighs_all_six_and_is_never_slower_than_a_zero_bubble_plan() -> None:
    prof = _sized(transformer_dag(6, hidden_bytes=1 << 22, split=True), 2, 16)  # 50 layers
    pool = [f"cuda:{i}" for i in range(4)]
    plan = partition(prof, devices=pool, memory_limit="2GiB", method="dp", **AUTO)  # type: ignore[arg-type]
    assert _fits(plan) and not plan.skipped_schedules
    found = re.search(r"Schedules weighed \(.*?\): (.*? ms)\.", plan.explain())
    assert found is not None
    weighed = found.group(1)
    for schedule in ("gpipe", "1f1b", "interleaved1f1b", *ZERO_BUBBLE_SCHEDULES):
        assert schedule in weighed, weighed
    compared = 0
    for schedule in ZERO_BUBBLE_SCHEDULES:
        for chunks, checkpoint in ((4, "never"), (8, "never"), (8, "except_last"), (16, "always")):
            try:
                fixed = partition(prof, devices=[pool[0], pool[1], pool[1], pool[0]] if schedule != "interleaved_zb"
                                  else pool[:2] * 2, chunks=chunks, batch_size=16, recompute=checkpoint,
                                  schedule=schedule, memory_limit="2GiB", method="dp", progress=False)
            except PartitionError:
                continue  # does not fit
            compared += 1
            assert plan.iteration_time <= fixed.iteration_time * (1 + 1e-12), (schedule, chunks)
    assert compared >= 6
    sim = simulate(plan, prof)
    assert sim.iteration_time == pytest.approx(plan.iteration_time)


def test_the_search_times_each_zero_bubble_plan_under_its_faster_merge_rule() -> None:
    # splitting costs 1.3x here, so merging every adjacent I and W wins under ZB-V ([Note:
    # adjacent I and W]); under DualPipeV on 2 ranks the rules run the same order
    base = random_chain(16, 7, split=True)
    prof = Profile.from_frame(base.df, meta={**base.meta, "bwd_split_ratio": 1.3})
    plans = {schedule: partition(prof, devices=["cpu:0", "cpu:1"], stages="auto", chunks=8, recompute="never",
                                 schedule=schedule, progress=False) for schedule in ("zbv", "auto")}
    zbv = plans["zbv"]
    other = Plan.from_stages(prof, zbv.stages, devices=zbv.devices, chunks=8, recompute="never", schedule="zbv",
                             merge_backward="unwaited")
    assert zbv.merge_backward == "adjacent" and zbv.iteration_time < other.iteration_time
    # the automatic search weighed ZB-V at its faster rule, and chose no slower
    assert f"zbv {zbv.iteration_time:.3f} ms" in plans["auto"].explain()
    assert plans["auto"].iteration_time <= zbv.iteration_time


def test_replicas_sync_after_the_last_weight_gradient() -> None:
    prof = _sized(random_chain(12, 3, split=True), 2, 8)
    plan = partition(prof, devices=[f"cuda:{i}" for i in range(4)], stages="auto", chunks=4, schedule="zbv",
                     data_parallel=2, bandwidth=1e9, progress=False)
    assert [d.name for d in plan.devices] == ["cuda:0", "cuda:1", "cuda:1", "cuda:0"]
    sim = simulate(plan)
    for s in range(4):  # after its last gradient: its last W, or its last whole backward
        last = max(e.end_ms for e in sim.timeline if e.stage == s and e.phase in ("backward", "weight"))
        assert all(e.start_ms >= last for e in sim.timeline if e.stage == s and e.phase == "allreduce")
