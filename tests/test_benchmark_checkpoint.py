"""benchmarks/checkpoint.py runs its tiny configuration in this process and prints its values.

One process only: 2 gloo ranks pay two interpreters' and tracers' start, past a unit test's
budget; the full benchmark runs them (docs/benchmarks.md, "Checkpoints"). Times are the
report's, no thresholds here; the cells must be the rows' values.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import checkpoint


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.timeout(120)
def test_checkpoint_benchmark_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows, overlaps = checkpoint.main(["--tiny", "--runtimes", "one"])
    assert [r.what for r in rows] == [*checkpoint.SAVES, *checkpoint.LOADS]
    for r in rows:
        assert r.runtime == "one process" and len(r.times) == 2 and all(t > 0 for t in r.times)
        assert r.size > 0
        assert (r.baseline is None) == (r.what in ("torch.save", "torch.load"))
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1].startswith("torch ") and " cores" in out[1]
    io_lines = [line for line in out if line.startswith("| one process |") and len(_cells(line)) == 7]
    assert len(io_lines) == len(rows)
    for line, r in zip(io_lines, rows, strict=True):
        cells = _cells(line)
        assert cells[1] == r.what
        assert float(cells[2]) == pytest.approx(r.ms, abs=0.051)
        assert cells[4] == ("-" if r.ratio is None else f"{r.ratio:.2f}")
        assert float(cells[5]) == pytest.approx(r.size / 2**20, abs=0.051)
        if r.baseline is not None:
            assert float(cells[6]) == pytest.approx(r.size / r.baseline.size, abs=0.0051)
    assert [o.mode for o in overlaps] == ["sync", "async"]
    loop_lines = [line for line in out if line.startswith("| one process |") and len(_cells(line)) == 9]
    assert len(loop_lines) == 2
    for line, o in zip(loop_lines, overlaps, strict=True):
        cells = _cells(line)
        assert cells[1] == o.mode and len(o.loop) == 2 and len(o.call) == 2 and len(o.none) == 2
        assert float(cells[5]) == pytest.approx(o.blocked, abs=0.051)
        assert math.isfinite(float(cells[8]))
    assert _cells(loop_lines[0])[8] == "1.00"  # sync's own ratio
