"""benchmarks/step_split.py runs, and its table says what it measured."""

from __future__ import annotations

from benchmarks import step_split


def test_step_split_table_runs_tiny() -> None:
    out = step_split.main(["--chains", "1"])
    command, machine, blank, head, _, *rows = out.splitlines()
    assert command == "python benchmarks/step_split.py --chains 1" and "(simulated)" in machine
    assert blank == "" and head.startswith("| schedule | DP's split slower")
    assert [r.split("|")[1].strip() for r in rows] == list(step_split.LAYOUTS)
    for row in rows:  # "step" found the fastest split of every chain: it is never slower
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[4] == "0 of 1" and cells[5] == "0.00%"
