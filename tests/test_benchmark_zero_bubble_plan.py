"""benchmarks/zero_bubble_plan.py runs end to end on a tiny synthetic DAG (no torch needed; the
real table is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from autopipe.core.simulator import simulate
from autopipe.errors import AutopipeError
from autopipe.solvers.partitioner import partition
from benchmarks import zero_bubble_plan as zb
from executor.spec import RECOMPUTE_MODES, ZERO_BUBBLE_SCHEDULES, stage_rank


def test_zero_bubble_table_runs_tiny() -> None:
    argv = ["--no-llama", "--dag-blocks", "2", "--ranks", "2", "--multiples", "1", "2",
            "--batch-per-rank", "8", "--fractions", "0.8"]
    out = zb.main(argv)
    command, machine, blank, head, _, *rows = out.splitlines()
    assert command == "python benchmarks/zero_bubble_plan.py " + " ".join(argv)
    assert "(simulated)" in machine and blank == "" and head.startswith("| profile | ranks K | M |")
    assert len(rows) == 4  # M = 2, 4, each without a limit and at 0.8
    for line in rows:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[4].split(",")[0] in zb.ONE_F_ONE_B and cells[6].split(",")[0] in ZERO_BUBBLE_SCHEDULES
        # baseline / zero bubble, from cells rounded to 0.1 ms
        assert float(cells[8].rstrip("x")) == pytest.approx(float(cells[5]) / float(cells[7]), rel=5e-3)


def test_every_plan_fits_its_limit_and_is_its_familys_best() -> None:
    """Each row's plan against every plan of its family the test makes itself: each schedule of
    the family on the row's ranks in the benchmark's layout (one stage per rank under 1F1B, two
    under the others, as executor.spec.stage_rank places them), with each recomputation mode
    for every stage and with the per-stage search; each timed again by the simulator from the
    profile and kept when its fullest device and stage fit the row's limit. The row's plan is
    as fast as the fastest of those, and no slower than any."""
    dag = zb.transformer_dag(2, hidden_bytes=4 << 20, split=True)
    dag.meta.update(micro_batch_size=2, batch_size=16, chunks=8)
    rows = zb.rows_for("dag", dag, [2], [2], 8, [0.8])
    assert [(row.ranks, row.chunks, row.limit is None) for row in rows] == [(2, 4, True), (2, 4, False)]
    for row in rows:
        ranks = [f"rank{r}" for r in range(row.ranks)]
        for plan, family in ((row.baseline, zb.ONE_F_ONE_B), (row.zero_bubble, ZERO_BUBBLE_SCHEDULES)):
            assert plan is not None and plan.schedule in family
            peak = max([*plan.device_memory.values(), *plan.stage_memory])
            assert row.limit is None or peak <= row.limit
            assert simulate(plan, dag).iteration_time == pytest.approx(plan.iteration_time, rel=1e-12)
            times = {}
            for schedule in family:
                per_rank = 1 if schedule == "1f1b" else 2
                layout = [ranks[stage_rank(schedule, s, row.ranks)] for s in range(per_rank * row.ranks)]
                for recompute in ("auto", *RECOMPUTE_MODES):
                    try:  # "auto" searches: it takes each rank once and lays them out itself
                        other = partition(dag, devices=ranks if recompute == "auto" else layout,
                                          chunks=row.chunks, batch_size=16, recompute=recompute,
                                          schedule=schedule, memory_limit=row.limit, method="exact",
                                          progress=False)
                    except AutopipeError:
                        continue  # nothing of this configuration fits
                    assert [d.name for d in other.devices] == layout
                    sim = simulate(other, dag)
                    if row.limit is None or max([*sim.device_memory.values(), *sim.peak_memory]) <= row.limit:
                        times[schedule, recompute] = sim.iteration_time
            assert len(times) >= len(family) + 2, times  # more than the per-stage searches alone
            assert plan.iteration_time == pytest.approx(min(times.values()), rel=1e-12), (plan.schedule, times)
