"""`autopipe partition --stages auto --chunks auto --recompute auto --schedule auto`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopipe.app.cli import main
from autopipe.core.plan import Plan
from autopipe.solvers.synthetic import random_chain


@pytest.fixture()
def profile_csv(tmp_path: Path) -> Path:
    prof = random_chain(16, 5)
    prof.meta.update(micro_batch_size=4, batch_size=16, chunks=4, device_type="cuda")
    return prof.save(tmp_path / "profiles" / "toy")


def test_everything_auto(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "auto.json"
    argv = ["partition", str(profile_csv), "--stages", "auto", "--devices", "4", "--chunks", "auto",
            "--recompute", "auto", "--schedule", "auto", "--memory", "200MiB", "--no-progress",
            "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Next best alternatives searched" in text and f"wrote {out}" in text
    plan = Plan.load(out)
    assert plan.num_stages <= 8 and plan.chunks in (1, 2, 4, 8, 16) and plan.batch_size == 16
    assert all(d.name.startswith("cuda:") for d in plan.devices)
    assert all(m <= 200 << 20 for m in plan.device_memory.values())


def test_per_stage_checkpoint_and_batch_size(profile_csv: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mixed.json"
    argv = ["partition", str(profile_csv), "--stages", "2", "--recompute", "always,never",
            "--schedule", "1f1b", "--chunks", "8", "--batch-size", "16", "--out", str(out)]
    assert main(argv) == 0
    plan = Plan.load(out)
    assert plan.recompute == ["always", "never"] and plan.schedule == "1f1b"
    assert (plan.chunks, plan.batch_size, plan.micro_batch_size) == (8, 16, 2)
    assert "always" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--stages", "auto"], r"stages='auto' chooses up to one stage per device: pass devices="),
        (["--stages", "two"], r"--stages 'two': give a whole number >= 1 or auto"),
        (["--stages", "2", "--chunks", "0"], r"--chunks '0': give a whole number >= 1 or auto"),
        (["--stages", "2", "--schedule", "zigzag"], r"schedule='zigzag': choose one of"),
        (["--stages", "2", "--recompute", "never,sometimes"], r"recompute=\['never', 'sometimes'\]"),
        (["--stages", "3", "--recompute", "never,always"], r"recompute lists 2 mode\(s\) for 3 stage\(s\)"),
        (["--stages", "2", "--chunks", "auto", "--batch-size", "0"], r"batch_size=0: need an integer"),
        (["--stages", "auto", "--devices", "3", "--memory", "1KiB"],
         r"no searched configuration fits the memory"),
    ],
)
def test_bad_values_are_one_line(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 extra: list[str], match: str) -> None:
    out = tmp_path / "p.json"
    assert main(["partition", str(profile_csv), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopipe: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err
    assert not out.exists()
