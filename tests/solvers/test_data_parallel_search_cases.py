"""autopipe/solvers/data_parallel_search.py on hand-made cases: which replica counts are planned,
the global batch they share, and how the search over them picks, ranks and reports."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import autopipe.solvers.data_parallel_search as data_parallel_search
from autopipe.core.plan import Alternative, Plan, SolverInfo
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.data_parallel_search import global_batch, replica_counts, search_replicas
from autopipe.solvers.synthetic import chain_profile


@pytest.mark.parametrize(("devices", "batch", "chunks", "counts"), [
    (6, 12, 1, [1, 2, 3, 6]),
    (6, 12, 4, [1, 2, 3]),  # 12 // 6 = 2 rows per replica < 4 micro-batches
    (6, 12, 3, [1, 2, 3]),
    (6, 12, "auto", [1, 2, 3, 6]),  # chunks chosen later: no row bound yet
    (6, 12, True, [1, 2, 3, 6]),  # not a count
    (6, 8, 1, [1, 2]),  # 3 and 6 do not split the batch
    (7, 14, 2, [1, 7]), (1, 5, 1, [1]),
])
def test_auto_plans_the_divisors_that_split_the_batch(devices: int, batch: int, chunks: object,
                                                     counts: list[int]) -> None:
    assert replica_counts("auto", devices, batch, chunks) == counts


def test_a_fixed_replica_count_is_checked() -> None:
    assert replica_counts(2, 4, 8, 4) == [2]
    assert replica_counts(3, None, None, 4) == [3]
    assert replica_counts(2, 4, 6, "auto") == [2]
    with pytest.raises(PartitionError, match=r"^data_parallel=8 > 4 devices: each replica needs at "
                                             r"least one; use data_parallel <= 4$"):
        replica_counts(8, 4, 8, 1)
    with pytest.raises(PartitionError, match=r"^data_parallel=3 does not divide the 4 devices \(K = N / D "
                                             r"stages each\); use one of \[1, 2, 4\] or 'auto'$"):
        replica_counts(3, 4, 12, 1)
    with pytest.raises(PartitionError, match=r"^batch_size=6 does not split evenly over data_parallel=4 "
                                             r"replicas; use a multiple of 4$"):
        replica_counts(4, 4, 6, 1)
    with pytest.raises(PartitionError, match=r"^data_parallel=2 leaves 5 rows of batch_size=10 per "
                                             r"replica, fewer than chunks=6; use chunks <= 5 or fewer "
                                             r"replicas$"):
        replica_counts(2, 4, 10, 6)
    assert replica_counts(2, 4, 10, 5) == [2]  # exactly chunks rows per replica fit


def _profile(**meta: object) -> Profile:
    prof = chain_profile([1.0, 2.0])
    prof.meta.update(meta)
    return prof


def test_the_global_batch() -> None:
    scalable = {"micro_batch_size": 2}
    assert global_batch(_profile(**scalable), 8, 2) == 8  # given
    assert global_batch(_profile(**scalable, batch_size=6), None, 2) == 6  # the profile's
    assert global_batch(_profile(**scalable, batch_size=1), None, "auto") == 1
    assert global_batch(_profile(**scalable, batch_size=0), None, 2) is None
    assert global_batch(_profile(**scalable, batch_size="6"), None, 2) is None
    assert global_batch(_profile(batch_size=6), None, 2) is None  # rows unrecorded: not scaled
    assert global_batch(_profile(**scalable), None, 2) is None
    with pytest.raises(PartitionError) as info:
        global_batch(_profile(**scalable), None, "auto")
    assert str(info.value) == ("data_parallel='auto' compares replica counts at one global batch: "
                               "pass batch_size=B (--batch-size B) with a profile that records its "
                               "micro-batch rows")
    with pytest.raises(PartitionError, match=r"^data_parallel=2 splits batch_size=8 over replicas, "
                                             r"but the profile does not record"):
        global_batch(_profile(), 8, 2)


def _plan(d: int, iteration: float, stages: int = 2, device_memory: dict[str, int] | None = None) -> Plan:
    prof = chain_profile([1.0, 1.0, 1.0, 1.0])
    split = [prof.layers[:2], prof.layers[2:]] if stages == 2 else [prof.layers[i:i + 1] for i in range(4)]
    plan = Plan.from_stages(prof, split, chunks=2)
    return dataclasses.replace(
        plan, data_parallel=d, iteration_time=iteration, bottleneck=iteration / 3,
        peak_memory=[100 * d, 300 * d, 200 * d][:stages] + [0] * max(0, stages - 3),
        device_memory=device_memory or {}, solver=SolverInfo(status=f"exact D={d}", seconds=0.5),
        alternatives=[Alternative(3, 2, "gpipe", "never", 99.0, 33.0, 7, "own runner-up", d)])


def test_search_replicas_keeps_the_fastest_and_lists_the_others_first(monkeypatch: pytest.MonkeyPatch) -> None:
    plans = {1: _plan(1, 30.0), 2: _plan(2, 10.0, 4, {"a": 5, "b": 9}), 4: _plan(4, 20.0)}
    clock = iter([100.0, 102.5])  # the search's start and end
    monkeypatch.setattr(data_parallel_search, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    def solve(d: int) -> Plan:
        if d == 8:
            raise PartitionError("too big")
        return plans[d]

    best = search_replicas([1, 2, 4, 8], solve)
    assert best.data_parallel == 2 and best.iteration_time == 10.0 and best.num_stages == 4
    assert best.alternatives == [
        Alternative(2, 2, "gpipe", best.alternatives[0].recompute, 20.0, 20.0 / 3, 1200,
                    "best with 4 replica(s)", 4),  # no device_memory: the highest stage peak
        Alternative(2, 2, "gpipe", best.alternatives[1].recompute, 30.0, 10.0, 300,
                    "best with 1 replica(s)", 1),
        Alternative(3, 2, "gpipe", "never", 99.0, 33.0, 7, "own runner-up", 2),
    ]
    assert [a.recompute for a in best.alternatives[:2]] == [plans[4].recompute, plans[1].recompute]
    assert best.solver.status == ("exact D=2; replicas chosen from [1, 2, 4, 8] by simulated "
                                  "iteration; 8 do(es) not fit")
    assert best.solver.seconds == 2.5  # the whole search's, not the winner's own solve's
    assert best.stages == plans[2].stages and best.peak_memory == plans[2].peak_memory


def test_search_replicas_breaks_ties_by_fewer_stages_and_says_nothing_of_none_unfit() -> None:
    plans = {1: _plan(1, 10.0, 4), 2: _plan(2, 10.0, 2)}
    best = search_replicas([1, 2], plans.__getitem__)
    assert best.data_parallel == 2
    assert best.solver.status == "exact D=2; replicas chosen from [1, 2] by simulated iteration"
    [other] = best.alternatives[:1]
    assert other.data_parallel == 1 and other.stages == 4 and other.memory == 300


def test_one_replica_count_is_its_plan_as_it_is() -> None:
    plan = _plan(2, 10.0)
    assert search_replicas([2], lambda d: plan) is plan


def test_search_replicas_says_why_none_fits() -> None:
    def solve(d: int) -> Plan:
        raise PartitionError(f"{d} replica(s) of 1 stage do not fit")

    with pytest.raises(PartitionError) as info:
        search_replicas([2], solve)
    assert str(info.value) == ("data_parallel=2: 2 replica(s) of 1 stage do not fit; fewer replicas "
                               "leave more devices to each")
    with pytest.raises(PartitionError) as info:
        search_replicas([4, 2], solve)
    assert str(info.value) == ("no replica count among [4, 2] fits; with data_parallel=2: 2 replica(s) "
                               "of 1 stage do not fit")
