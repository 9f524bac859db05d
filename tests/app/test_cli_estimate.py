"""``autopipe profile MODEL --estimate SHEET``, then partition: a plan for devices never used."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.app.cli import main
from autopipe.core.profile_table import Profile


def test_estimate_then_partition_for_devices_this_machine_lacks(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mlp.csv"
    rc = main(["profile", "mlp", "--estimate", "h100", "--precision", "bf16", "--batch-size", "16",
               "--chunks", "2", "--out", str(out), "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "ESTIMATED on device sheet h100 (NVIDIA H100 SXM5 80GB), not measured" in cap.out
    prof = Profile.load(out)
    assert prof.meta["estimated"]["name"] == "h100" and prof.meta["precision"] == "bf16"
    assert prof.corrections.loss is not None  # the example's loss, counted
    rc = main(["partition", str(out), "--stages", "auto", "--devices", "8", "--chunks", "auto",
               "--recompute", "auto", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    explained = cap.out.split("\n\n")[1]
    assert explained.startswith("ESTIMATED, not measured: every time and byte below was counted on device "
                                "sheet h100 (NVIDIA H100 SXM5 80GB)")
    assert "cuda:0" in cap.out  # --devices N: the sheet's kind of device


@pytest.mark.parametrize(("flags", "message"), [
    (["--estimate", "h1000"], "no device sheet 'h1000': shipped sheets are ['a100-40gb',"),
    (["--estimate", "h100", "--comm-from", "link.json"], "--estimate h100 and --comm-from link.json"),
    (["--estimate", "nowhere/sheet.json"], "device sheet file nowhere/sheet.json does not exist"),
])
def test_bad_estimates_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            flags: list[str], message: str) -> None:
    rc = main(["profile", "mlp", "--out", str(tmp_path / "mlp.csv"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("autopipe: error: ") and message in err
    assert err.count("\n") == 1 and not (tmp_path / "mlp.csv").exists()
