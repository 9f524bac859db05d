from __future__ import annotations

import math
import re

import pytest

from autopipe import AutopipeError, PlanError
from autopipe.app.cli import main
from autopipe.app.train import train_example


def test_trains_a_bundled_example_end_to_end() -> None:
    lines: list[str] = []
    report = train_example("mlp", stages=2, chunks=4, batch_size=16, steps=4, lr=1e-2,
                           log=lines.append)
    assert len(report.plan.stages) == 2
    assert len(report.losses) == 4 and report.losses[-1] < report.losses[0]
    assert report.median_step_ms > 0 and report.baseline_ms > 0
    assert "measured/predicted" in report.summary()
    assert any(line.startswith("step 4/4") for line in lines)


def test_cli_train_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    assert main(["train", "unet", "--stages", "2", "--chunks", "2", "--batch-size", "4",
                 "--steps", "2"]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^step (\d+/\d+)  loss (\S+)", out, flags=re.M)
    assert [s for s, _ in steps] == ["1/2", "2/2"] and all(math.isfinite(float(v)) for _, v in steps)
    assert "unet: 2 stages x 2 micro-batches" in out and "measured/predicted" in out
    assert main(["train", "nope"]) == 2
    assert "unknown example 'nope'" in capsys.readouterr().err
    assert main(["train", "mlp", "--stages", "2", "--devices", "cpu"]) == 2
    assert "1 devices for 2 stages" in capsys.readouterr().err
    assert main(["train", "mlp", "--batch-size", "2", "--chunks", "4"]) == 2
    assert "chunks=4 > batch size 2: micro-batches would be empty" in capsys.readouterr().err


def test_bad_arguments() -> None:
    with pytest.raises(AutopipeError, match="steps=0"):
        train_example("mlp", steps=0, log=None)
    with pytest.raises(PlanError):
        train_example("mlp", plan="does/not/exist.json", log=None)
