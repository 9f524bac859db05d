"""[Note: automatic search]: stages, micro-batches, recomputation and schedule by simulated time."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest

import autopipe.solvers.search as search_module
from autopipe.core.cost import DeviceSpec
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate, simulate_stages
from autopipe.errors import PartitionError
from autopipe.solvers import stage_dp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.search import chunk_candidates
from autopipe.solvers.search_space import plan_devices, stages_per_rank
from autopipe.solvers.synthetic import chain_profile, random_chain, transformer_dag
from executor.spec import RECOMPUTE_MODES, SCHEDULES, check_schedule

AUTO = dict(stages="auto", chunks="auto", recompute="auto", schedule="auto", progress=False)


def _sized(prof: Profile, micro: int = 4, batch: int = 16) -> Profile:
    prof.meta.update(micro_batch_size=micro, batch_size=batch, chunks=batch // micro)
    return prof


def _fits(plan: Plan) -> bool:
    limits = {d.name: d.memory for d in plan.devices}
    per_stage = all(d.memory is None or m <= d.memory for m, d in zip(plan.stage_memory, plan.devices, strict=True))
    return per_stage and all(limits[n] is None or m <= limits[n] for n, m in plan.device_memory.items())


def test_auto_is_never_slower_than_any_fixed_choice_it_searched() -> None:
    # all six schedules: the profile splits its backward, as the zero-bubble ones need
    prof = _sized(random_chain(10, 4, split=True), micro=4, batch=8)
    pool = ["d0", "d1", "d2"]
    auto = partition(prof, devices=pool, memory_limit="48MiB", method="dp", **AUTO)  # type: ignore[arg-type]
    assert _fits(auto)
    compared, schedules = 0, set()
    for k in range(1, 4):
        for m in chunk_candidates(8, 64):
            for schedule in SCHEDULES:
                devices = [d.name for d in plan_devices(schedule, [DeviceSpec(n) for n in pool[:k]])]
                try:
                    check_schedule(schedule, len(devices), k, m)
                except ValueError:
                    continue
                if stages_per_rank(schedule) > 1 and k < 2:
                    continue
                for checkpoint in (*RECOMPUTE_MODES, "auto"):
                    try:
                        fixed = partition(prof, devices=devices, chunks=m, batch_size=8, schedule=schedule,
                                          recompute=checkpoint, memory_limit="48MiB", method="dp", progress=False)
                    except PartitionError:
                        continue  # does not fit
                    compared += 1
                    schedules.add(schedule)
                    assert auto.iteration_time <= fixed.iteration_time * (1 + 1e-12), (k, m, schedule, checkpoint)
    assert compared > 30 and schedules == set(SCHEDULES)


def test_the_search_states_the_gap_to_a_bound_no_configuration_beats() -> None:
    # its configurations are not all split for their fastest step: the plan says how far from
    # the least bound over the space it searched it may be, and every plan of that space,
    # each configuration split for its own fastest step, is no faster than that bound
    prof = _sized(random_chain(9, 4, split=True), micro=4, batch=8)
    pool = ["d0", "d1", "d2", "d3"]
    plan = partition(prof, devices=pool, **AUTO)  # type: ignore[arg-type]
    bound, gap = plan.solver.bound, plan.solver.gap
    assert plan.solver.status.startswith("best of ") and bound is not None and gap is not None
    assert 0 < bound <= plan.iteration_time and gap == pytest.approx(1 - bound / plan.iteration_time)
    assert f"gap {100 * gap:.2f}%" in plan.explain()
    compared = 0
    for k, m, schedule in itertools.product((2, 4), (2, 4, 8), ("gpipe", "1f1b", "zbv")):
        devices = [d.name for d in plan_devices(schedule, [DeviceSpec(n) for n in pool[:k // stages_per_rank(schedule)]])]
        try:
            check_schedule(schedule, len(devices), k // stages_per_rank(schedule), m)
        except ValueError:
            continue
        fixed = partition(prof, devices=devices, chunks=m, batch_size=8, schedule=schedule, recompute="never",
                          method="step", progress=False)
        assert fixed.solver.status == "optimal" and fixed.iteration_time >= bound * (1 - 1e-12)
        compared += 1
    assert compared >= 12


@pytest.mark.parametrize("limit", ["6GiB", "3GiB", "2GiB"])
def test_the_chosen_plan_never_exceeds_a_memory_limit(limit: str) -> None:
    prof = _sized(transformer_dag(25, hidden_bytes=8 << 20), micro=8, batch=64)  # 202 layers
    plan = partition(prof, devices=[f"cuda:{i}" for i in range(8)], memory_limit=limit, method="dp",
                     **AUTO)  # type: ignore[arg-type]
    assert _fits(plan), plan.explain()
    sim = simulate(plan, prof)
    assert sim.peak_memory == plan.peak_memory and sim.device_memory == plan.device_memory
    assert max(sim.device_memory.values()) <= (int(limit[0]) << 30)
    assert sim.iteration_time == pytest.approx(plan.iteration_time)


def test_fewer_stages_when_transfers_dominate() -> None:
    # every cut sends 1 GB at 1 GB/s: no split can beat one stage
    prof = chain_profile([1.0] * 6, output_bytes=10**9)
    plan = partition(prof, stages="auto", devices=["a", "b", "c"], chunks=4, bandwidth=1e9, progress=False)
    assert plan.num_stages == 1
    cheap = partition(prof, stages="auto", devices=["a", "b", "c"], chunks=4, bandwidth=None, progress=False)
    assert cheap.num_stages == 3


def test_a_dominant_layer_caps_the_useful_stages() -> None:
    prof = chain_profile([0.1, 0.1, 10.0, 0.1, 0.1, 0.1])
    plan = partition(prof, stages="auto", devices=[f"d{i}" for i in range(5)], chunks=2,
                     schedule="gpipe", bandwidth=None, progress=False)
    five = partition(prof, devices=[f"d{i}" for i in range(5)], chunks=2, bandwidth=None)
    assert plan.num_stages < 5 and plan.iteration_time <= five.iteration_time
    assert plan.alternatives and all(a.iteration_time >= plan.iteration_time for a in plan.alternatives)


def test_heterogeneous_devices_are_respected() -> None:
    prof = chain_profile([1.0] * 12, output_bytes=10**8)
    pool = [DeviceSpec("slow", None, 1.0), DeviceSpec("fast", None, 4.0), DeviceSpec("slow2", None, 1.0)]
    plan = partition(prof, stages="auto", devices=pool, chunks=4, bandwidth=1e9, schedule="gpipe",
                     progress=False)
    assert all(d in pool for d in plan.devices)
    if plan.num_stages == 1:
        assert plan.devices == [pool[1]]  # the fastest device alone
    else:
        sizes = {d.name: len(s) for d, s in zip(plan.devices, plan.stages, strict=True)}
        assert sizes["fast"] == max(sizes.values())
    # a small memory on the fast device pushes layers to the roomy slow ones
    pool[1] = DeviceSpec("fast", 3 << 20, 4.0)
    prof = chain_profile([1.0] * 12, param_bytes=[1 << 20] * 12)
    plan = partition(prof, devices=pool, chunks=4, bandwidth=None, optimizer="none", recompute="auto",
                     progress=False)
    assert [len(s) for s in plan.stages][1] <= 3 and _fits(plan)


def test_chunks_auto_plans_micro_batches_of_the_batch() -> None:
    prof = _sized(random_chain(12, 1), micro=4, batch=16)
    plan = partition(prof, stages=3, chunks="auto", progress=False)
    assert plan.chunks in chunk_candidates(16, 64) and plan.batch_size == 16
    assert plan.micro_batch_size == math.ceil(16 / plan.chunks)
    scale = plan.micro_batch_size / 4  # [Note: micro-batch scaling]: compute per row
    assert sum(b.fwd_ms for b in plan.breakdown) == pytest.approx(scale * prof.df["fwd_ms"].sum())
    capped = partition(prof, stages=3, chunks="auto", max_chunks=4, progress=False)
    assert capped.chunks <= 4
    with pytest.raises(PartitionError, match=r"^chunks='auto' needs the mini-batch size: pass batch_size=B"):
        partition(random_chain(12, 1), stages=3, chunks="auto")


def test_1f1b_memory_instead_of_recomputation() -> None:
    # 8 micro-batches of 64 MiB a stage do not fit 200 MiB under GPipe; 1F1B keeps 2 or 1
    prof = chain_profile([1.0] * 8, saved_bytes=[32 << 20] * 8, output_bytes=1 << 10)
    kw = dict(stages=2, chunks=8, memory_limit="200MiB", optimizer="none", bandwidth=None, progress=False)
    gpipe = partition(prof, schedule="gpipe", recompute="auto", **kw)  # type: ignore[arg-type]
    assert "never" not in gpipe.stage_recompute[:1]
    best = partition(prof, schedule="auto", recompute="auto", **kw)  # type: ignore[arg-type]
    assert best.schedule != "gpipe" and best.recompute == "never"
    assert best.iteration_time < gpipe.iteration_time
    text = best.explain()
    assert "Next best alternatives searched" in text and "| 1f1b | never |" in text and "| chosen |" in text
    assert len(best.alternatives) >= 1


def test_the_ilp_refines_only_the_winner_of_a_dag() -> None:
    prof = _sized(transformer_dag(2), micro=2, batch=8)  # 18 layers with skips beside one order
    plan = partition(prof, devices=["a", "b", "c"], time_limit=5, **AUTO)  # type: ignore[arg-type]
    assert plan.method in ("exact", "step") and _fits(plan)  # the order is the DAG's only one: no ILP
    dp = partition(prof, devices=["a", "b", "c"], method="dp", **AUTO)  # type: ignore[arg-type]
    assert plan.iteration_time <= dp.iteration_time
    assert plan.solver.status in ("optimal", "time_limit", "feasible") or "simulated" in plan.solver.status


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": "auto"}, r"^stages='auto' chooses up to one stage per device: pass devices="),
        ({"stages": "many"}, r"^stages='many': need an integer K >= 1 or 'auto'$"),
        ({"stages": 2, "chunks": "lots"}, r"^chunks='lots': need an integer"),
        ({"stages": 2, "schedule": "zigzag"}, r"^schedule='zigzag': choose one of"),
        ({"stages": 2, "recompute": ["never", "maybe"]}, r"^recompute=\['never', 'maybe'\]: choose one of"),
        ({"stages": 2, "recompute": ["never"] * 3}, r"^recompute lists 3 mode\(s\) for 2 stage\(s\)"),
        ({"stages": 2, "chunks": 1, "schedule": "1f1b"}, r"^schedule='1f1b' needs chunks >= stages \(2\)"),
        ({"stages": 2, "chunks": 4, "batch_size": 2}, r"^chunks=4 > batch_size=2"),
        ({"stages": 3, "devices": ["a", "b"], "schedule": "auto"}, r"^stages=3 but only 2 devices given"),
        ({"stages": "auto", "devices": ["a", "b"], "method": "uniform"}, r"^method='uniform' splits one"),
        ({"stages": 2, "chunks": 4, "memory_limit": "1KiB", "schedule": "auto"},
         r"^no searched configuration fits the memory; with 2 device\(s\), 4 micro-batches"),
    ],
)
def test_bad_choices_are_one_line(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PartitionError, match=match) as err:
        partition(random_chain(10), progress=False, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_search_800_layers_16_devices_solves_few_dps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's work on 802 layers and 16 devices, counted, not timed (~5 s on 2 idle
    cores, 20-40 s beside other jobs; the search's seconds are benchmarks/auto_plan.py's): the
    bounds prune the 265 configurations to 40 DP solves (42 passes with the 2 for other
    schedules' alternatives) and 12 simulations, 14 with the interleaving schedules' best splits
    again for their step ([Note: the step, not the bottleneck]), in at most 3765 block evaluations that compute
    at most 980 cached arrays (blocks are cached per memory terms, whose d ([Note: an input kept
    once]) sets apart some that were one; one a block for what Adam's step holds: [Note: the
    optimizer step's memory] in stage_memory.py). The counts are deterministic: nothing reads a clock."""
    counts = {"passes": 0, "blocks": 0, "simulated": 0}
    fresh: list[tuple[object, ...]] = []
    configs: list[int] = []
    suffix_minmax, store = stage_dp.suffix_minmax, stage_dp.StageBlocks._store
    all_configs = search_module._Search.configs

    def counted_pass(n: int, r_max: int, cost: stage_dp.BlockCost) -> Any:
        def counted(r: int, j0: int, j1: int) -> Any:
            counts["blocks"] += 1
            return cost(r, j0, j1)
        counts["passes"] += 1
        return suffix_minmax(n, r_max, counted)

    def counted_store(self: stage_dp.StageBlocks, key: tuple[object, ...], value: Any) -> Any:
        fresh.append((id(self), *key))
        return store(self, key, value)

    def counted_simulation(*args: Any, **kwargs: Any) -> Any:
        counts["simulated"] += 1
        return simulate_stages(*args, **kwargs)

    def counted_configs(self: Any) -> Any:
        out = all_configs(self)
        configs.append(len(out))
        return out

    monkeypatch.setattr(stage_dp, "suffix_minmax", counted_pass)
    monkeypatch.setattr(stage_dp.StageBlocks, "_store", counted_store)
    monkeypatch.setattr(search_module, "simulate_stages", counted_simulation)
    monkeypatch.setattr(search_module._Search, "configs", counted_configs)
    prof = _sized(transformer_dag(100), micro=8, batch=64)  # 802 layers, memory binds at 2 GiB
    plan = partition(prof, devices=[f"cuda:{i}" for i in range(16)], memory_limit="2GiB", **AUTO)  # type: ignore[arg-type]
    assert _fits(plan)
    assert configs[0] == 265  # the space searched: pruning, not a smaller space, saves the work
    said = re.fullmatch(r"best of (\d+) simulated configurations \((\d+) DP solves\)", plan.solver.status)
    assert said is not None and int(said[1]) == counts["simulated"], plan.solver.status
    assert int(said[2]) <= 40 and counts["passes"] <= int(said[2]) + 2  # + other schedules' alternatives
    assert counts["simulated"] <= 14 and counts["blocks"] <= 3765
    assert len(fresh) <= 980


def test_interleaved_with_a_stage_count_puts_two_stages_on_each_rank() -> None:
    prof = random_chain(12, 2)
    prof.meta["device_type"] = "cuda"
    plan = partition(prof, stages=4, chunks=4, schedule="interleaved1f1b")
    assert [d.name for d in plan.devices] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert set(plan.device_memory) == {"cuda:0", "cuda:1"}
    with pytest.raises(PartitionError, match=r"runs 2 stages on each rank: give an even stages \(not 3\)"):
        partition(prof, stages=3, chunks=4, schedule="interleaved1f1b")
    # in a search, stages=4 is four stages under every schedule: two ranks of two when interleaved
    both = partition(prof, stages=4, chunks=4, schedule="interleaved1f1b", recompute="auto",
                     devices=["a", "b", "c", "d"], progress=False)
    assert both.num_stages == 4 and len(both.device_memory) == 2
    with pytest.raises(PartitionError, match="each listed once"):
        partition(prof, stages=4, chunks=4, schedule="interleaved1f1b", recompute="auto",
                  devices=["a", "b", "a", "b"], progress=False)
