"""``autopipe calibrate``: a sheet written where asked, one line for what it cannot do."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.app.cli import main
from autopipe.core.device_sheet import load_sheet
from autopipe.frontend.profiling.estimated import calibrate as calibration


def test_calibrate_writes_a_sheet_that_estimate_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A few small shapes (the real command measures dozens up to 2048-wide matmuls, ~10 s)."""
    few = [s for s in calibration.shapes_for("cpu") if s.label.startswith(("Linear 8x16", "add 1024 ", "sdpa 8x"))]
    monkeypatch.setattr(calibration, "shapes_for", lambda kind: few)
    monkeypatch.setattr(calibration, "MAX_SIDE", {"cpu": 128})
    monkeypatch.setattr(calibration, "COPY_BYTES", {"cpu": 1 << 20})
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--out", str(out), "--repeats", "1", "--threads", "1", "--name", "here"]) == 0
    printed = capsys.readouterr().out
    assert "device sheet 'here'" in printed and f"wrote {out}" in printed
    sheet = load_sheet(out)
    assert sheet.name == "here" and sheet.device_type == "cpu" and "1 torch thread" in sheet.device
    assert main(["profile", "mlp", "--estimate", str(out), "--out", str(tmp_path / "mlp.csv"), "--no-progress"]) == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--repeats", "0"], "--repeats 0 < 1"),
    (["--threads", "0"], "--threads 0 < 1"),
    (["--device", "tpu"], "calibrate measures a cpu or a cuda device, not 'tpu'"),
    (["--host-allocator", "mine"], "--host-allocator 'mine' is unknown"),
])
def test_bad_calibrations_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               flags: list[str], message: str) -> None:
    rc = main(["calibrate", "--out", str(tmp_path / "x.json"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1


def test_an_existing_sheet_is_not_overwritten_before_measuring(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.json"
    out.write_text("mine", encoding="utf-8")
    assert main(["calibrate", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text(encoding="utf-8") == "mine"
