"""autopipe.app.launch (`autopipe run`), autopipe.app.rank_main and the torchrun user script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopipe
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.launch import torchrun_command
from autopipe.app.rank_main import main as rank_main
from autopipe.errors import BuildError

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_command_names_every_setting() -> None:
    cmd = torchrun_command(RunConfig("mlp", nproc=3, plan="plans/mlp.json", steps=2, chunks=4))
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=3" in cmd and cmd[cmd.index("-m", 3) + 1] == "autopipe.app.rank_main"
    sent = RunConfig.from_json(cmd[cmd.index("--config") + 1])  # what every rank reads
    assert sent == RunConfig("mlp", nproc=3, plan="plans/mlp.json", steps=2, chunks=4)
    assert sent.checkpoint is None  # left to the plan


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (RunConfig("resnet"), "unknown example 'resnet'"),
        (RunConfig("mlp", nproc=0), "--nproc 0 < 1"),
        (RunConfig("mlp", steps=0), "--steps 0 < 1"),
        (RunConfig("mlp", schedule="zb"), "--schedule 'zb' is unknown"),
    ],
)
def test_bad_run_configs(config: RunConfig, match: str) -> None:
    with pytest.raises(BuildError, match=match):
        torchrun_command(config)


def test_cli_run_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "mlp", "--nproc", "0"]) == 2
    assert "autopipe: error: --nproc 0 < 1" in capsys.readouterr().err


def test_rank_main_refuses_to_run_outside_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert rank_main(["--config", RunConfig("mlp").to_json()]) == 2
    assert "start me with torchrun" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_cli_run_trains_a_bundled_example_with_a_saved_plan(tmp_path: Path,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    ex = autopipe.get_example("mlp", batch_size=16)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=2, warmup=1)
    plan_path = tmp_path / "mlp.json"
    autopipe.partition(prof, stages=2, chunks=4).save(plan_path)
    rc = main(["run", "mlp", "--plan", str(plan_path), "--nproc", "2", "--steps", "3",
               "--batch-size", "16", "--timeout", "30"])
    out = capfd.readouterr().out
    assert rc == 0, out
    assert out.count("loss") == 3 and "samples/s" in out and "2 ranks" in out


@pytest.mark.timeout(90)
def test_user_script_under_torchrun_trains_and_merges(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "examples" / "train_distributed.py"), "--steps", "2", "--batch-size", "16",
           "--chunks", "4", "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("loss") == 2 and "merged 2 stage checkpoints" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]
