"""benchmarks/zero_bubble_plan.py runs end to end on a tiny synthetic DAG (no torch needed; the
real table is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks import zero_bubble_plan as zb
from executor.spec import ZERO_BUBBLE_SCHEDULES


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
    dag = zb.transformer_dag(2, hidden_bytes=4 << 20, split=True)
    dag.meta.update(micro_batch_size=2, batch_size=16, chunks=8)
    for row in zb.rows_for("dag", dag, [2], [2], 8, [0.8]):
        for plan, family in ((row.baseline, zb.ONE_F_ONE_B), (row.zero_bubble, ZERO_BUBBLE_SCHEDULES)):
            assert plan is not None and plan.schedule in family
            assert row.limit is None or zb._peak(plan) <= row.limit
            others = zb._best(dag, family, row.ranks, row.chunks, 16, row.limit)
            assert others is not None and plan.iteration_time == others.iteration_time
