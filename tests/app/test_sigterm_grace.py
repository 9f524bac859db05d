"""[Note: SIGTERM grace]: a SIGTERM lets the process finish its report, and ends it anyway when the
main thread is blocked where no Python handler can run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals")

CHILD = textwrap.dedent("""
    import sys, threading, time
    from autopipe.app import sigterm_grace
    grace = sigterm_grace.install(grace_s={grace})
    print("ready", flush=True)
    if sys.argv[1] == "blocked":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # blocks in C for ever: the main thread never runs a Python handler
    else:  # the report takes a while to come, then the process ends by itself
        time.sleep(0.5)
        print("PipelineFailure: rank 0/2: pipeline step 3 (gpipe)", file=sys.stderr, flush=True)
        grace.finish(3)
        threading.Event().wait()  # a shutdown that never ends: the SIGTERM ends the process with 3
""")


def _terminated(mode: str, grace: float) -> tuple[subprocess.CompletedProcess[str], float]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(grace=grace), mode], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start


def test_a_terminated_process_still_writes_its_report_and_keeps_its_status() -> None:
    done, took = _terminated("reports", grace=10.0)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == "PipelineFailure: rank 0/2: pipeline step 3 (gpipe)"
    assert took < 10.0  # ended once its report was written, not at the grace's end


def test_a_process_blocked_outside_python_ends_after_the_grace() -> None:
    done, took = _terminated("blocked", grace=0.5)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 0.4 < took < 20.0
