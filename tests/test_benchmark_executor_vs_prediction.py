"""benchmarks/executor_vs_prediction.py runs tiny over every example and checkpoint mode, and its
table is consistent (the numbers themselves: the report; no timing thresholds here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _module():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "executor_vs_prediction.py"
    spec = importlib.util.spec_from_file_location("executor_vs_prediction", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["executor_vs_prediction"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_executor_vs_prediction_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _module()
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
