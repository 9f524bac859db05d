"""benchmarks/executor_vs_prediction.py runs tiny over every example and checkpoint mode, and its
table is consistent (the numbers themselves: the report; no timing thresholds here)."""

from __future__ import annotations

import pytest

from benchmarks import executor_vs_prediction


def test_executor_vs_prediction_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    bench = executor_vs_prediction
    rows = bench.main(["--batch", "8", "--chunks", "2", "--repeats", "1"])
    assert [(r.model, r.checkpoint) for r in rows] == [
        (m, c) for m in ("mlp", "cnn", "gpt", "unet") for c in ("never", "except_last", "always")]
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        predicted, measured, ratio, before, before_ratio = map(float, cells[4:9])
        assert predicted > 0 and measured > 0 and before > 0
        assert ratio == pytest.approx(measured / predicted, abs=2e-3, rel=2e-3)
        assert before_ratio == pytest.approx(measured / before, abs=2e-3, rel=2e-3)
    for r in rows:  # without recomputation the overheads only add a call cost >= 0
        if r.checkpoint == "never":
            assert r.predicted_ms >= r.before_ms - 1e-9
