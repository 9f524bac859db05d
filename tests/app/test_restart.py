"""`autopipe run --max-restarts N`: a rank killed (SIGKILL) or hung (SIGSTOP) mid-step, or killed
mid-save, ends every rank within the timeout; torchrun restarts the group, the ranks resume from the
newest whole checkpoint and finish with the parameters of an uninterrupted run, bit for bit; the
log says what failed, where the run resumed and which steps it ran again.

Each launch runs several faults, one per attempt (AUTOPIPE_FAULT's ``attempt=``), to pay for the
ranks' start-up as few times as possible; the uninterrupted run is computed in this process
(tests/app/test_checkpoint_flags.py's ``plain_run``, bit for bit what the ranks compute)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopipe.app.config import RunConfig
from autopipe.app.launch import NO_DISTRIBUTED_CALL_COST, PLANNED_HERE, run
from autopipe.app.restart_watch import TorchrunWatch
from autopipe.app.torchrun import describe_attempts, diagnose
from autopipe.examples import get_example
from executor.checkpoint import load_checkpoint
from tests.app.test_checkpoint_flags import plain_run

_FAILURE = ("PipelineFailure: rank 0/2: pipeline step 3 (gpipe, stages [0]) failed: a peer rank died, hung or "
            "failed ([/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:6348. This is typically caused by a remote worker crashing. GLHF!); see that rank's log\n")


def test_diagnose_names_a_hung_peer_and_shortens_gloos_cause(tmp_path: Path) -> None:
    assert diagnose({0: _FAILURE}, "", 4, tmp_path) == (
        f"rank 0 stopped at pipeline step 3 (gpipe): a peer rank died or hung (Connection closed by peer "
        f"[127.0.0.1]:6348); the ranks' logs are in {tmp_path}")
    assert diagnose({0: _FAILURE}, "", 4, tmp_path, first=(0, 3), hung=[3]).startswith(
        "rank 0 stopped at pipeline step 3 (gpipe): its peer rank 3 hung; ")


TORCHRUN_SIGKILL_S = 30  # torchrun's wait between its SIGTERM and its SIGKILL

_FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "1"})
os.kill(child.pid, signal.SIGSTOP)
time.sleep(0.3)
print(f"W1201 api.py:1028] Sending process {child.pid} closing signal SIGTERM", file=sys.stderr, flush=True)
os.kill(child.pid, signal.SIGTERM)
start = time.monotonic()
code = child.wait(timeout=20)
print(f"{code} {time.monotonic() - start:.1f}", flush=True)
print("E1201 api.py:1002] failed (exitcode: 3) local_rank: 0 (pid: 1) of binary: x", file=sys.stderr, flush=True)
"""


def test_a_stopped_rank_is_continued_into_torchruns_sigterm_and_the_attempt_reported(tmp_path: Path) -> None:
    attempt = tmp_path / "torchrun" / "run-id" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stderr.log").write_text(_FAILURE)
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_TORCHRUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    said = io.StringIO()
    watch = TorchrunWatch(proc, tmp_path / "torchrun.log", 2, 1, describe_attempts(tmp_path / "torchrun", 2),
                          out=said).start()
    assert proc.stdout is not None
    out = proc.stdout.read()  # torchrun's stderr is the watch's
    proc.wait(timeout=30)
    watch.join()
    code, took = out.decode().split()
    # ended by the SIGTERM (a stopped process keeps it pending until continued, and the fake
    # sends no SIGKILL: -15 means the watch continued it), and long before torchrun's SIGKILL
    # would have come: within a third of its 30 s, however loaded the host (it takes ~0.3 s)
    assert code == "-15" and float(took) < TORCHRUN_SIGKILL_S / 3
    lines = said.getvalue().splitlines()
    assert re.fullmatch(r"autopipe run: rank 1 \(pid \d+\) was stopped \(SIGSTOP, or hung in state T\) when "
                        r"torchrun sent it SIGTERM: continued it so that it ends now, not at torchrun's "
                        r"SIGKILL 30 s later", lines[0]), lines
    assert lines[1:] == [f"autopipe run: attempt 1 of 2 failed: rank 0 stopped at pipeline step 3 (gpipe): its "
                         f"peer rank 1 hung; the ranks' logs are in {attempt}; torchrun restarts all 2 ranks "
                         "(restart 1 of --max-restarts 1)"]
    assert "closing signal SIGTERM" in (tmp_path / "torchrun.log").read_text()


def _same_as_uninterrupted(folder: Path, steps: int, replicas: int) -> None:
    model = get_example("mlp", 8).model
    assert load_checkpoint(folder, model).step == steps
    for (key, want), got in zip(plain_run(steps, replicas=replicas).items(), model.state_dict().values(),
                                strict=True):
        assert torch.equal(want, got), key


def _losses(out: str, steps: int) -> dict[int, set[str]]:
    """Each step's printed losses (a redone step's, printed again, must be the same)."""
    seen: dict[int, set[str]] = {}
    for step, loss in re.findall(rf"^step +(\d+)/{steps}  loss (\S+)$", out, flags=re.M):
        seen.setdefault(int(step), set()).add(loss)
    return seen


@pytest.mark.slow
@pytest.mark.timeout(270)
def test_two_stages_survive_a_kill_a_kill_mid_save_and_a_hang(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Two stages on two ranks: one launch, one fault per attempt. (Replicas resume from the same
    checkpoints: tests/assemble/test_replicas_checkpoint.py; a torchrun launch of 4 ranks per
    attempt costs twice the start-ups for the same restart path.)"""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    faults = ("rank=1,step=3,signal=KILL;"                       # attempt 0: killed mid-step 3
              "rank=0,step=4,signal=KILL,when=save,attempt=1;"   # attempt 1: killed saving step 4
              "rank=1,step=5,signal=STOP,attempt=2")             # attempt 2: hung in step 5
    assert run(RunConfig("mlp", nproc=2, batch_size=8, chunks=2, steps=6, timeout=2,
                         first_step_timeout=60, checkpoint_dir=str(ckpt), checkpoint_every=2, max_restarts=3),
               log_dir=logs, extra_env={"AUTOPIPE_FAULT": faults}) == 0
    out, err = capfd.readouterr()
    assert PLANNED_HERE in out and NO_DISTRIBUTED_CALL_COST not in err  # planned here: one line, no warning
    assert (f"autopipe run: restart 1: resumed from {ckpt}/step-00000002 at step 2 of 6; the failed run had "
            "reached step 3: step 3 runs again (1 redone)\n") in out
    assert (f"autopipe run: restart 2: resumed from {ckpt}/step-00000002 at step 2 of 6; the failed run had "
            "reached step 4: steps 3..4 run again (2 redone) (step-00000004.partial: a save that did not "
            "finish, ignored)\n") in out  # the killed save left its .partial, step 2 loaded whole
    assert (f"autopipe run: restart 3: resumed from {ckpt}/step-00000004 at step 4 of 6; the failed run had "
            "reached step 5: step 5 runs again (1 redone)\n") in out
    lines = [line for line in err.splitlines() if line.startswith("autopipe run:")]
    assert re.match(r"autopipe run: attempt 1 of 4 failed: rank \d stopped at pipeline step 3 \(gpipe\): its "
                    r"peer rank 1 was killed by SIGKILL; the ranks' logs are in ", lines[0]), err
    assert lines[0].endswith("; torchrun restarts all 2 ranks (restart 1 of --max-restarts 3)")
    assert lines[1].startswith("autopipe run: attempt 2 of 4 failed: rank 0 was killed by SIGKILL"), err
    assert re.fullmatch(r"autopipe run: rank 1 \(pid \d+\) was stopped .*", lines[2]), err
    assert re.match(r"autopipe run: attempt 3 of 4 failed: rank \d stopped at pipeline step 5 \(gpipe\): its "
                    r"peer rank 1 hung; ", lines[3]), err
    assert lines[4] == f"autopipe run: finished after 3 restart(s); each attempt's logs are in {logs}/torchrun"
    assert all(len(losses) == 1 for losses in _losses(out, 6).values()) and len(_losses(out, 6)) == 6
    assert sorted(p.name for p in ckpt.iterdir()) == ["autopipe-progress.json", "step-00000002",
                                                      "step-00000004", "step-00000006"]
    _same_as_uninterrupted(ckpt, 6, replicas=1)
