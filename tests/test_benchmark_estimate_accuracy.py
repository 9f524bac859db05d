"""benchmarks/estimate_accuracy.py runs tiny: an estimate and a measured profile of one model side
by side. Times are the report's (on a sheet of another device here, so no thresholds); the bytes
do not depend on any timing: the estimate's are the measured profile's, to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.device_sheet import load_sheet
from benchmarks import estimate_accuracy


def test_estimate_accuracy_runs_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sheet = load_sheet("h100").to_json()
    sheet.update(name="a-cpu", device_type="cpu")  # a CPU's optimizer steps one tensor at a time, as measured
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(sheet), encoding="utf-8")
    (row,) = estimate_accuracy.main(["--models", "mlp", "--sheet", str(path), "--repeats", "1", "--warmup", "0"])
    assert row.model == "mlp" and row.layers == 15 and row.measured_ms > 0
    assert row.saved_ratio == 1.0 and row.memory_ratio == 1.0
    assert row.layers_ratio > 0 and row.step_ratio > 0 and row.per_layer[0] <= row.per_layer[1] <= row.per_layer[2]
    out = capsys.readouterr()
    assert out.out.splitlines()[2].startswith("| mlp | 15 |") and "sheet a-cpu (given)" in out.err
