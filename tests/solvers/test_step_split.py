"""The split with the shortest simulated step ([Note: the step, not the bottleneck]): checked
against every split of the layer order, each evaluated by Plan.from_stages on its own."""

from __future__ import annotations

import itertools
import re

import pytest

from autopipe.core.cost import LayerCosts
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers import step_split
from autopipe.solvers.bounds import config_bound, pipeline_bound
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.stage_dp import budget_devices
from autopipe.solvers.synthetic import random_chain, torch_workloads

# schedule -> the device of each of 4 stages (two ranks hold two each; None: one per stage)
LAYOUTS = {"gpipe": None, "1f1b": None, "interleaved1f1b": ["r0", "r1", "r0", "r1"], "zbv": ["r0", "r1", "r1", "r0"]}


def _every_split(prof: Profile, like: Plan, memory: int | None = None) -> list[Plan]:
    """Every contiguous split of ``prof``'s layers into ``like``'s stages, as plans; with
    ``memory``, only those whose every stage fits it."""
    layers, k = prof.layers, like.num_stages
    plans = []
    for cuts in itertools.combinations(range(1, len(layers)), k - 1):
        bounds = (0, *cuts, len(layers))
        plan = Plan.from_stages(prof, [layers[a:b] for a, b in itertools.pairwise(bounds)],
                                devices=like.devices, chunks=like.chunks, schedule=like.schedule,
                                recompute=like.recompute, bandwidth=like.bandwidth)
        if memory is None or max(plan.stage_memory) <= memory:
            plans.append(plan)
    return plans


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_the_split_is_the_fastest_step_of_every_split(schedule: str, seed: int) -> None:
    prof = random_chain(8 + seed % 3, seed, split=True)
    plan = partition(prof, stages=4, devices=LAYOUTS[schedule], chunks=8, schedule=schedule,
                     recompute="never", method="step")
    fastest = min(p.iteration_time for p in _every_split(prof, plan))
    assert plan.iteration_time == pytest.approx(fastest, rel=1e-9)
    assert plan.method == "step" and plan.solver.status == "optimal"  # a chain: its only order
    assert plan.solver.objective == pytest.approx(plan.iteration_time) and plan.solver.gap == 0.0


def test_the_fastest_step_can_have_a_slower_bottleneck_than_the_dps() -> None:
    """The case the step exists for: seed 0's 10 layers under interleaved 1F1B, where the split
    of the smallest bottleneck (the DP's) steps over 10% slower than the best split."""
    prof = random_chain(10, 0, split=True)
    plan = partition(prof, stages=4, devices=LAYOUTS["interleaved1f1b"], chunks=8,
                     schedule="interleaved1f1b", recompute="never", method="step")
    options = CostOptions(8, "never", schedule="interleaved1f1b")
    dp = solve_dp(LayerCosts.from_profile(prof), budget_devices(plan.devices, "interleaved1f1b"), options)
    layers = prof.layers
    split = [[n for n, s in zip(layers, dp.assignment, strict=True) if s == t] for t in range(4)]
    even = Plan.from_stages(prof, split, devices=plan.devices, chunks=8, schedule="interleaved1f1b",
                            recompute="never")
    assert even.bottleneck == pytest.approx(dp.bottleneck) and plan.bottleneck > even.bottleneck
    assert plan.iteration_time < even.iteration_time * 0.9


def test_a_memory_limit_keeps_every_stage_within_it() -> None:
    prof = random_chain(10, 5, split=True)
    free = partition(prof, stages=4, chunks=8, schedule="1f1b", recompute="never", method="exact")
    limit = sorted(free.stage_memory)[-1] - 1  # the free plan's largest stage no longer fits
    plan = partition(prof, stages=4, chunks=8, schedule="1f1b", recompute="never", method="step",
                     memory_limit=limit)
    fitting = _every_split(prof, plan, memory=limit)
    assert fitting and max(plan.stage_memory) <= limit
    assert plan.iteration_time == pytest.approx(min(p.iteration_time for p in fitting), rel=1e-9)


@pytest.mark.parametrize("limit", [None, "100MiB"], ids=["free", "memory limited"])
def test_a_descent_is_never_slower_than_its_seeds_and_states_its_gap(monkeypatch: pytest.MonkeyPatch,
                                                                    limit: str | None) -> None:
    # as for a model of many layers: neither every split simulated nor every split bounded; with
    # no limit the batch bound is the step, so the descent simulates nothing; with one, what it moves to
    monkeypatch.setattr(step_split, "ENUMERATE_SPLITS", 0)
    monkeypatch.setattr(step_split, "BOUNDED_WORK", 0)
    prof = random_chain(14, 2, split=True)
    kw = dict(stages=4, devices=LAYOUTS["zbv"], chunks=8, schedule="zbv", recompute="never", memory_limit=limit)
    plan = partition(prof, method="step", **kw)  # type: ignore[arg-type]
    seeds = [partition(prof, method=m, **kw).iteration_time for m in ("uniform", "params", "blockpartition")]  # type: ignore[arg-type]
    said = re.fullmatch(r"descent over (\d+) splits \((\d+) simulated\)", plan.solver.status)
    assert plan.method == "step" and said is not None, plan.solver.status
    assert int(said[1]) >= 4 and int(said[2]) <= step_split.DESCENT_EVALUATIONS
    assert (int(said[2]) == 0) == (limit is None)
    assert plan.iteration_time <= min(seeds) + 1e-9
    bound = config_bound("zbv", LayerCosts.from_profile(prof), [1.0] * 4, 8)
    assert plan.solver.bound == pytest.approx(bound) and plan.solver.bound <= plan.iteration_time
    assert plan.solver.gap == pytest.approx(1 - bound / plan.iteration_time)
    assert f"gap {100 * plan.solver.gap:.2f}%" in plan.explain()


def test_exact_keeps_the_dps_split_whose_slowest_stage_is_the_smallest() -> None:
    prof = random_chain(10, 0, split=True)
    kw = dict(stages=4, devices=LAYOUTS["zbv"], chunks=8, schedule="zbv", recompute="never")
    exact, step = partition(prof, method="exact", **kw), partition(prof, method="step", **kw)
    assert exact.method == "exact" and exact.solver.objective == pytest.approx(exact.bottleneck)
    assert step.iteration_time < exact.iteration_time and step.bottleneck >= exact.bottleneck


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
def test_auto_takes_the_fastest_step_under_every_schedule(schedule: str, seed: int) -> None:
    # the default method, against every split scored on its own: the fastest, and so never
    # slower than the DP's or a baseline's split
    prof = random_chain(8 + seed % 3, seed + 10, split=True)
    kw = dict(stages=4, devices=LAYOUTS[schedule], chunks=8, schedule=schedule, recompute="never")
    plan = partition(prof, **kw)  # type: ignore[arg-type]
    assert plan.iteration_time == pytest.approx(min(p.iteration_time for p in _every_split(prof, plan)), rel=1e-9)
    for other in ("exact", "uniform", "params", "blockpartition"):
        assert plan.iteration_time <= partition(prof, method=other, **kw).iteration_time * (1 + 1e-9), other  # type: ignore[arg-type]
    assert plan.method in ("exact", "step") and plan.solver.gap == 0.0


def test_auto_under_gpipe_takes_the_fastest_step_where_the_dps_is_slower() -> None:
    # seed 6's 14 layers: the DP's split, one of several with the smallest slowest stage, steps
    # 1% slower than the fastest split, which has that slowest stage too
    prof = random_chain(14, 6, split=True)
    kw = dict(stages=4, chunks=8, recompute="never")
    auto, exact = partition(prof, **kw), partition(prof, method="exact", **kw)  # type: ignore[arg-type]
    fastest = min(p.iteration_time for p in _every_split(prof, auto))
    assert exact.iteration_time > fastest * 1.005 and auto.bottleneck == pytest.approx(exact.bottleneck)
    assert auto.method == "step" and auto.iteration_time == pytest.approx(fastest, rel=1e-9)


def test_step_takes_one_configuration_in_one_line() -> None:
    with pytest.raises(PartitionError, match=r"^method='step' splits one given configuration; with "
                                             r"'auto' choices use method='auto', 'exact' or 'ilp'$"):
        partition(random_chain(6, 0), stages="auto", devices=["cpu:0", "cpu:1"], method="step")



@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_the_automatic_search_takes_its_configurations_fastest_step(schedule: str, seed: int) -> None:
    # stages chosen by the search, its winner split again for the step: the fastest of every
    # split of the configuration it chose
    prof = random_chain(9, seed + 20, split=True)
    plan = partition(prof, stages="auto", devices=["d0", "d1", "d2", "d3"], chunks=8, schedule=schedule,
                     recompute="never", progress=False)
    assert plan.num_stages > 1
    assert plan.iteration_time == pytest.approx(min(p.iteration_time for p in _every_split(prof, plan)), rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_where_auto_does_not_search_every_split_it_states_the_gap(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # as for a model of many layers: a descent, whose plan states its gap to a bound no split
    # beats (the pipeline's under GPipe, the totals' under ZB-V), even where it kept the DP's split
    monkeypatch.setattr(step_split, "ENUMERATE_SPLITS", 0)
    monkeypatch.setattr(step_split, "BOUNDED_WORK", 0)
    prof = random_chain(30, 1, split=True)
    plan = partition(prof, stages=4, devices=LAYOUTS[schedule], chunks=8, schedule=schedule)
    assert plan.method == "step" and plan.solver.status.startswith("descent over ")
    costs, devices = LayerCosts.from_profile(prof), plan.devices
    options = CostOptions(8, plan.recompute, schedule=schedule)
    bound = max(config_bound(schedule, costs, [1.0] * 4, 8), pipeline_bound(costs, devices, options) or 0.0)
    assert plan.solver.bound == pytest.approx(bound) and 0 < plan.solver.gap < 1
    assert plan.solver.gap == pytest.approx(1 - bound / plan.iteration_time)
    assert f"gap {100 * plan.solver.gap:.2f}%" in plan.explain()


def test_an_enumeration_cut_short_states_the_bound_of_the_splits_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # under a memory limit each split the batch cannot rule out is simulated; after one, the
    # splits left are no faster than the next one's batch bound (seed 0: the seeds' splits,
    # simulated first, are 2% slower than the fastest)
    monkeypatch.setattr(step_split, "BOUNDED_SIMULATIONS", 1)
    prof = random_chain(12, 0, split=True)
    kw = dict(stages=4, chunks=8, schedule="1f1b", recompute="never")
    limit = max(partition(prof, **kw).stage_memory) * 2  # type: ignore[arg-type]
    plan = partition(prof, method="step", memory_limit=limit, **kw)  # type: ignore[arg-type]
    said = re.fullmatch(r"(\d+) of 165 splits simulated, the rest bounded", plan.solver.status)
    assert said is not None, plan.solver.status
    fastest = min(p.iteration_time for p in _every_split(prof, plan))
    assert plan.solver.bound is not None and plan.solver.bound <= fastest <= plan.iteration_time
    assert f"gap {100 * plan.solver.gap:.2f}%" in plan.explain()


@pytest.mark.parametrize(("name", "schedule", "ranks"), [
    ("rebalance x8", "1f1b", ["r0", "r1", "r2", "r3"]),  # torch's own regression case
    ("heavy cuts x12", "interleaved1f1b", ["r0", "r1", "r2", "r3"] * 2),  # 8 stages on 4 ranks
])
def test_on_torchs_workloads_the_default_is_the_fastest_split(name: str, schedule: str, ranks: list[str]) -> None:
    # torch.distributed.pipelining's auto_partition tests (autopipe.solvers.synthetic): the DP's
    # split, torch's starting point too, steps over 4% slower than the fastest
    w = next(w for w in torch_workloads() if w.name == name)
    kw = dict(stages=len(ranks), devices=ranks, chunks=w.chunks, schedule=schedule, recompute="never",
              bandwidth=w.bandwidth)
    plan, exact = partition(w.profile, **kw), partition(w.profile, method="exact", **kw)  # type: ignore[arg-type]
    fastest = min(p.iteration_time for p in _every_split(w.profile, plan))
    assert plan.iteration_time == pytest.approx(fastest, rel=1e-9) and plan.solver.gap == 0.0
    assert exact.iteration_time > fastest * 1.04
