"""benchmarks/ppdp.py's simulated part runs end to end on tiny synthetic profiles (no torch)."""

from __future__ import annotations

from benchmarks import ppdp


def test_ppdp_simulated_table_runs_tiny() -> None:
    table = ppdp.main(["--no-llama", "--devices", "4", "--fractions", "2", "0.3",
                            "--dag-blocks", "1", "--chain-layers", "8", "--global-batch", "16"])
    lines = table.splitlines()
    assert lines[0].startswith("| profile | N |") and len(lines) >= 4
    for line in lines[2:]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1] == "4"
        replicas, ranks = cells[3].split(",")[0].split(" (")[0].split(" x ")
        assert int(replicas) * int(ranks) <= 4
        # the planned configuration is never slower than the pure ones it searched
        for speedup in (cells[7], cells[9]):
            assert not speedup or float(speedup.rstrip("x")) >= 1.0 - 1e-9
