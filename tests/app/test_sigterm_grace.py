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

HANG_S = 20.0  # the longest a child may take to end after its SIGTERM: a hang, under any load

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
    try:
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()  # no-op once it ended; a hung child does not outlive the test
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start


def test_a_terminated_process_still_writes_its_report_and_keeps_its_status() -> None:
    # a grace far past HANG_S: a process that waited for the grace's end would not end in the
    # test's time at all (it takes ~0.6 s: start, the 0.5 s report, exit)
    done, took = _terminated("reports", grace=10 * HANG_S)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == "PipelineFailure: rank 0/2: pipeline step 3 (gpipe)"
    assert took < HANG_S  # ended once its report was written, not at the grace's end


def test_a_process_blocked_outside_python_ends_after_the_grace() -> None:
    done, took = _terminated("blocked", grace=0.5)
    # 128 + SIGTERM is the grace's own exit (the default action's would be -SIGTERM, faulthandler's
    # backstop 1): ended by the grace, not before it (a load only lengthens it), not hung
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 0.49 < took < HANG_S
