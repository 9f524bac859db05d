from __future__ import annotations

import dataclasses
import io
import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.cbc_log import CbcLog, SolverProgress
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import ILPResult, solve_ilp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain, transformer_dag
from tests.solvers.brute import (
    best_dag_bottleneck,
    least_memory,
    with_backward,
    with_buffers,
    with_loss,
)
from tests.solvers.cbc_limits import record_cbc_limits


def _two_branches(tie: bool = False) -> Profile:
    """a -> b1 -> b2 -> d and a -> c1 -> c2 -> d, rows interleaved (a, b1, c1, b2, c2, d); the
    branch-internal edges carry 1 MB, the rest 1 KB."""
    df = pd.DataFrame({
        "layer": ["a", "b1", "c1", "b2", "c2", "d"],
        "fwd_ms": [1.0, 4.0, 1.0, 1.0, 4.0, 1.0],
        "bwd_ms": [0.0] * 6,
        "param_bytes": [100, 500, 100, 100, 500, 100],
        "output_bytes": [1] * 6,
        "saved_bytes": [10] * 6,
        "saved_shared_bytes": [0, 0, 0, 8, 8, 0],  # b2, c2 save b1's, c1's output again
        "tie_group": ["", "w", "", "", "w", ""] if tie else [""] * 6,
    })
    big, small = 10**6, 10**3
    edges = [("a", "b1", small), ("a", "c1", small), ("b1", "b2", big), ("c1", "c2", big),
             ("b2", "d", small), ("c2", "d", small)]
    return Profile.from_frame(df, edges=edges)


def test_ilp_beats_dp_by_cutting_thin_values() -> None:
    lc = LayerCosts.from_profile(_two_branches())
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    opts = CostOptions(chunks=2, recompute="never", bandwidth=1e9)  # 1 MB = 1 ms
    dp = solve_dp(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=20)
    assert ilp.status == "optimal" and ilp.gap <= 0.005
    assert ilp.assignment == [0, 0, 1, 0, 1, 1]  # {a, b1, b2} | {c1, c2, d}
    assert ilp.objective < dp.bottleneck - 1.0  # the DP must cut a 1 MB branch edge
    assert ilp.objective == pytest.approx(best_dag_bottleneck(lc, devices, opts), rel=1e-6)


@pytest.mark.parametrize("ties", ["share", "colocate"])
def test_ilp_matches_brute_force_with_ties_and_memory(ties: str) -> None:
    lc = LayerCosts.from_profile(_two_branches(tie=True))
    opts = CostOptions(chunks=2, recompute="never", optimizer="none", bandwidth=1e9, ties=ties)
    devices = [DeviceSpec("a", 900), DeviceSpec("b", 900), DeviceSpec("c", 900)]
    expected = best_dag_bottleneck(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, time_limit=20)
    assert ilp.objective == pytest.approx(expected, rel=1e-6)
    costs = stage_costs(lc, ilp.assignment, devices, opts)
    assert all(c.memory_bytes <= 900 for c in costs)
    if ties == "colocate":
        assert ilp.assignment[1] == ilp.assignment[4]


def test_ilp_equals_dp_on_chains() -> None:
    for seed in range(3):
        lc = LayerCosts.from_profile(random_chain(12, seed))
        total = stage_costs(lc, [0] * 12, [DeviceSpec("x")], CostOptions())[0].memory_bytes
        devices = [DeviceSpec("a", total // 2, 1.0), DeviceSpec("b", total // 2, 2.0), DeviceSpec("c", total // 2)]
        opts = CostOptions(bandwidth=1e9)
        dp = solve_dp(lc, devices, opts)
        ilp = solve_ilp(lc, devices, opts, time_limit=20)
        assert ilp.objective == pytest.approx(dp.bottleneck, rel=1e-6)


def test_ilp_infeasible_memory() -> None:
    lc = LayerCosts.from_profile(_two_branches())
    with pytest.raises(PartitionError, match="no split into 2 stages within the memory limits"):
        solve_ilp(lc, [DeviceSpec("a", 100), DeviceSpec("b", 100)], CostOptions(), time_limit=5)


@dataclass(frozen=True)
class _Solved:
    dp: float  # the DP's bottleneck: the warm start
    result: ILPResult
    events: list[tuple[SolverProgress, bool]]  # each progress call, and whether CBC still ran


def _cbc_running() -> bool:
    """A child process of this one named cbc exists (Linux /proc)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, rest = text[text.find("(") + 1:text.rfind(")")], text[text.rfind(")") + 1:].split()
        if rest[1] == me and comm.startswith("cbc"):
            return True
    return False


@pytest.fixture(scope="module")
def solved_100() -> _Solved:
    """A 98-layer DAG into 5 stages, warm-started from the DP: a second or two of branch and
    bound, with every progress call recorded (benchmarks/partition_speed.py times the 202-layer
    one into 6 stages)."""
    lc = LayerCosts.from_profile(transformer_dag(12))  # 98 layers, 24 skips, tied head
    devices = [DeviceSpec(f"d{s}") for s in range(5)]
    opts = CostOptions(bandwidth=10e9)
    dp = solve_dp(lc, devices, opts)
    live = sys.platform.startswith("linux")
    events: list[tuple[SolverProgress, bool]] = []
    result = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=60,
                       on_progress=lambda p: events.append((p, live and _cbc_running())))
    return _Solved(dp.bottleneck, result, events)


@pytest.mark.slow
def test_ilp_100_layer_dag_five_stages_is_proven_optimal(solved_100: _Solved) -> None:
    ilp = solved_100.result
    assert ilp.gap <= 0.005 and ilp.status == "optimal"
    assert ilp.objective <= solved_100.dp + 1e-9


def test_ilp_progress_is_read_from_cbc_while_it_solves(solved_100: _Solved) -> None:
    events = [p for p, _ in solved_100.events]
    result = solved_100.result
    assert len(events) >= 3
    for a, b in itertools.pairwise(events):  # as they improve, never back (CBC prints 7 digits)
        assert b.seconds >= a.seconds and b.nodes >= a.nodes
        if a.incumbent is not None:
            assert b.incumbent is not None and b.incumbent <= a.incumbent * (1 + 1e-6)
        if a.bound is not None:
            assert b.bound is not None and b.bound >= a.bound * (1 - 1e-6)
    found = [p for p in events if p.incumbent is not None]
    assert found[0].incumbent == pytest.approx(solved_100.dp, rel=1e-5)  # CBC's MIPStart line
    assert found[0].bound is not None and found[0].gap is not None and found[0].gap > 0.01
    last = events[-1]
    assert last.incumbent == pytest.approx(result.objective, rel=1e-6)
    assert last.bound == pytest.approx(result.bound, rel=1e-6) and last.nodes > 0
    assert last.gap is not None and last.gap <= 0.005
    assert re.fullmatch(r"best [\d.]+ ms, bound [\d.]+ ms, gap \d+\.\d%, [\d,]+ nodes",
                        last.describe())
    if sys.platform.startswith("linux"):  # live: the first incumbent arrived while CBC ran
        assert any(running for p, running in solved_100.events if p.incumbent is not None)


def test_ilp_stopped_on_time_keeps_the_warm_start_and_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """CBC gets the time limit (1 s, wall clock) and, stopped by it, the warm start and the
    relaxation's bound are what the ILP reports. CBC runs with a limit it always overruns
    (tests/solvers/cbc_limits.py): with the real 1 s, where it stops depends on the host's speed
    and load (a loaded host may not finish the relaxation, a fast one may find a better split)."""
    lc = LayerCosts.from_profile(transformer_dag(25))
    devices = [DeviceSpec(f"d{s}") for s in range(6)]
    opts = CostOptions(bandwidth=10e9)
    dp = solve_dp(lc, devices, opts)
    events: list[SolverProgress] = []
    limits = record_cbc_limits(monkeypatch, overrun=True)
    ilp = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=1,
                    on_progress=events.append)
    assert limits == [(1, "elapsed")]  # `cbc -sec 1 -timeMode elapsed`
    assert ilp.status == "time_limit" and ilp.assignment == dp.assignment
    assert ilp.objective == pytest.approx(dp.bottleneck)
    assert 0.01 < ilp.gap < 0.2 and ilp.bound < ilp.objective  # the root bound, not a proof
    assert events[-1].bound == pytest.approx(ilp.bound, rel=1e-6) and events[-1].nodes == 0


def test_a_failed_cbc_keeps_the_warm_start_or_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # PuLP raises PulpSolverError when CBC cannot run or leaves no solution (it was a stack trace
    # out of partition(method="auto"))
    import pulp

    def fail(self: object, lp: object, callback: object = None) -> None:
        raise pulp.PulpSolverError("Pulp: Error while executing /opt/cbc\nmore")

    monkeypatch.setattr(pulp.PULP_CBC_CMD, "actualSolve", fail)
    lc = LayerCosts.from_profile(transformer_dag(3))
    devices = [DeviceSpec(f"d{s}") for s in range(3)]
    dp = solve_dp(lc, devices, CostOptions())
    with pytest.warns(RuntimeWarning, match=r"CBC failed \(Pulp: Error while executing /opt/cbc\); the plan keeps"):
        ilp = solve_ilp(lc, devices, CostOptions(), warm_start=dp.assignment, time_limit=5)
    assert ilp.assignment == dp.assignment and ilp.status == "feasible"
    with pytest.raises(PartitionError, match=r"^CBC failed \(Pulp: Error while executing /opt/cbc\); "
                                             r"partition with method='exact'$"):
        solve_ilp(lc, devices, CostOptions(), time_limit=5)
    with pytest.warns(RuntimeWarning, match="CBC failed"):  # the public entry point, too
        plan = partition(_two_branches(), stages=2, method="ilp")
    assert len(plan.stages) == 2


def test_ilp_within_a_gap_reports_the_bound_cbc_proved() -> None:
    lc = LayerCosts.from_profile(transformer_dag(25))
    devices = [DeviceSpec(f"d{s}") for s in range(6)]
    opts = CostOptions(bandwidth=10e9)
    dp = solve_dp(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, warm_start=dp.assignment, gap=0.05, time_limit=60)
    # CBC stops at the root: 4% from the root bound is within the 5% asked for
    assert ilp.status == "optimal" and 0.01 < ilp.gap <= 0.05
    assert ilp.objective == pytest.approx(dp.bottleneck)


def test_cbc_log_parses_each_kind_of_line() -> None:
    log = CbcLog(gap=0.01)
    for line in ["Continuous objective value is 10.5 - 0.01 seconds",
                 "Cbc0010I After 0 nodes, 1 on tree, 1e+50 best solution, best possible 10.6 (0.1 seconds)",
                 "Cbc0045I MIPStart provided solution with cost 13",
                 "Cbc0012I Integer solution of 12.5 found by feasibility pump after 0 iterations",
                 "Cbc0010I After 100 nodes, 7 on tree, 12.5 best solution, best possible 11 (2 seconds)",
                 "Cbc0004I Integer solution of 12.0000001 found after 9 iterations and 150 nodes"]:
        log.feed(line)
    assert (log.incumbent, log.bound, log.nodes) == (12.0000001, 11.0, 100)
    assert not log.stopped_on_time
    log.feed("Cbc0020I Exiting on maximum time")
    log.feed("Objective value:                12.00000000")  # more digits of the same split
    assert log.stopped_on_time and log.incumbent == 12.0 and log.bound == 11.0
    log.feed("Result - Optimal solution found (within gap tolerance)")
    assert log.bound == pytest.approx(12.0 * 0.99)
    log.feed("Cbc0011I Exiting as integer gap of 0.05 less than 1e-10 or 1%")
    assert log.bound == pytest.approx(11.95)
    exact = CbcLog()
    for line in ["Cbc0045I MIPStart provided solution with cost 5",
                 "Cbc0001I Search completed - best objective 5, took 0 iterations and 3 nodes"]:
        exact.feed(line)
    assert exact.state(1.0) == SolverProgress(1.0, 5.0, 5.0, 3) and exact.state(1.0).gap == 0.0


# --- progress through autopipe.partition ---------------------------------------------------


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


_PROGRESS = re.compile(r"ilp: .* s, best ([\d.]+) ms, bound ([\d.]+) ms, gap [\d.]+%, [\d,]+ nodes")


def test_partition_shows_ilp_progress_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Terminal())
    plan = partition(transformer_dag(2), stages=3, method="ilp")
    shown = _PROGRESS.findall(sys.stderr.getvalue())  # type: ignore[attr-defined]
    assert shown, sys.stderr.getvalue()  # type: ignore[attr-defined]
    assert float(shown[-1][0]) == pytest.approx(plan.solver.objective, rel=1e-3)


@pytest.mark.parametrize("progress,terminal,shown", [
    (None, False, False),  # the default off a terminal (pytest's capture): silent
    (False, True, False),  # progress=False: silent even on a terminal
    (True, False, True),  # progress=True: shown anyway
])
def test_partition_progress_switch(progress: bool | None, terminal: bool, shown: bool,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    partition(transformer_dag(2), stages=3, method="ilp", progress=progress)
    err = sys.stderr.getvalue() if terminal else capsys.readouterr().err  # type: ignore[attr-defined]
    assert bool(_PROGRESS.search(err)) is shown, err
    if not shown:
        assert err == ""


@pytest.mark.parametrize("flags,shown", [([], True), (["--no-progress"], False)])
def test_cli_partition_progress_on_a_terminal(flags: list[str], shown: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from autopipe.app.cli import main

    prof = transformer_dag(2).save(tmp_path / "dag.csv")
    monkeypatch.setattr(sys, "stderr", _Terminal())
    argv = ["partition", str(prof), "--stages", "3", "--method", "ilp", "--out", str(tmp_path / "p.json")]
    assert main([*argv, *flags]) == 0
    assert bool(_PROGRESS.search(sys.stderr.getvalue())) is shown  # type: ignore[attr-defined]


def test_partition_refuses_a_progress_that_is_not_a_bool() -> None:
    with pytest.raises(PartitionError, match="progress must be True, False or None") as info:
        partition(transformer_dag(2), stages=3, progress="yes")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("binds", "seed", "schedule"), [
    ("loss", 0, "gpipe"), ("loss", 1, "gpipe"),  # [Note: the loss's memory], on ranks for odd seeds
    # [Note: the backward's memory]: GPipe's first backward (the gradients appearing layer by
    # layer) and 1F1B's later ones (every gradient and a working set)
    ("backward", 0, "gpipe"), ("backward", 1, "gpipe"), ("backward", 0, "1f1b"), ("backward", 1, "1f1b")])
def test_ilp_equals_dp_where_the_memory_binds(binds: str, seed: int, schedule: str) -> None:
    lc, _ = with_loss(seed, 7) if binds == "loss" else with_backward(seed, 7)
    opts = CostOptions(chunks=3 if binds == "loss" else 4, recompute="never", bandwidth=1e9, schedule=schedule,
                       optimizer="adam" if binds == "loss" else "sgd")
    limit = int(least_memory(lc, 3, opts) * 1.1)
    devices = [DeviceSpec(s, limit) for s in "abc"]
    dp = solve_dp(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, time_limit=20)
    assert ilp.objective == pytest.approx(dp.bottleneck, rel=1e-6)
    assert all(c.memory_bytes <= limit for c in stage_costs(lc, ilp.assignment, devices, opts))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ilp_fits_where_the_receive_buffers_bind(schedule: str) -> None:
    # [Note: receive buffers]: the ILP charges the buffers and the input gradient in flight as
    # the walk does, and (on the safe side) the first layer's save of the received input again
    lc, _ = with_buffers(1, 7)
    opts = CostOptions(chunks=4, recompute="never", bandwidth=1e9, schedule=schedule, optimizer="sgd")
    limit = int(least_memory(lc, 3, opts) * 1.3)
    devices = [DeviceSpec(s, limit) for s in "abc"]
    ilp = solve_ilp(lc, devices, opts, time_limit=20)
    assert all(c.memory_bytes <= limit for c in stage_costs(lc, ilp.assignment, devices, opts))
    assert ilp.objective >= solve_dp(lc, devices, opts).bottleneck * (1 - 1e-6)
    no_aliases = dataclasses.replace(lc, saved_input=np.zeros_like(lc.saved_input))  # then exactly the DP's
    assert solve_ilp(no_aliases, devices, opts, time_limit=20).objective == pytest.approx(
        solve_dp(no_aliases, devices, opts).bottleneck, rel=1e-6)
