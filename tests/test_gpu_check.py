"""benchmarks/gpu_check.sh --dry-run: every import, command and flag of the GPU check resolves
on the CPU, under whichever torch runs the suite (.ci/compat runs it on torch 2.11, the GPU
machine's); bad arguments are refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(*args: str, out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    # The python running the tests is the script's python3, as the image's is there.
    env = {**os.environ, "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # the script puts the tree on it itself
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.compat
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("AUTOPIPE_COMPAT_JOB") != "1",
                    reason="a minute of real runs: CI's compat jobs run it on torch 2.11 (the GPU "
                           "machine's) and 2.15 (.ci/compat sets AUTOPIPE_COMPAT_JOB=1; set it to "
                           "run it here)")
def test_dry_run_resolves_every_step_and_prints_one_table(tmp_path: Path) -> None:
    done = _run("--dry-run", out=tmp_path, timeout=590)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    steps = [row.split("|")[1].strip() for row in rows[1:]]
    assert steps == ["torch and device", "CUDA tests", "profile mlp", "profile cnn", "profile gpt",
                     "profile unet", "measured vs predicted", "measured vs predicted, busy GPU",
                     "Llama-70B shape, layer by layer"]
    status = [row.split("|")[2].strip() for row in rows[1:]]
    assert set(status) == {"ok"}, summary
    assert "tests collected" in summary and "measured / predicted" in summary
    assert summary in done.stdout  # the table is the run's last output
    for ex in ("mlp", "cnn", "gpt", "unet"):
        assert (tmp_path / "profiles" / "cuda" / f"{ex}.json").exists()


def test_an_unknown_argument_is_one_line(tmp_path: Path) -> None:
    done = _run("--dryrun", out=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_check.sh: unknown argument '--dryrun'; use --dry-run, --wheels or none"]
