"""torchrun's stderr read as it is written: each failed attempt said before torchrun restarts
the ranks, and a stopped rank continued into torchrun's SIGTERM.

[Note: a restart in the log] With ``--max-restarts N`` torchrun's elastic agent restarts every
rank after one fails, without a word on its stderr but the failure (``failed (exitcode: C)
local_rank: R``, logged once the whole group is down). :class:`TorchrunWatch` reads torchrun's
stderr line by line as it comes (into ``torchrun.log``) and, for each failed attempt that
torchrun will restart, prints that attempt's one line (autopipe/app/torchrun.py's diagnosis of
the attempt's own logs) and the restart; the restarted rank 0 then prints where the run resumed
and which steps it runs again ([Note: resuming a run] in autopipe/app/run_checkpoints.py). A
rank that is stopped (SIGSTOP, a debugger's stop: a hang that SIGTERM cannot end) when torchrun
sends the group SIGTERM would hold the restart for torchrun's 30 s before its SIGKILL; the
watch sends such a rank, and only a child of this torchrun in state T with that SIGTERM
pending, SIGCONT, so that the SIGTERM ends it at once (Linux: read from /proc; elsewhere
torchrun's SIGKILL comes after its 30 s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["TorchrunWatch", "Describe"]

_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_CLOSING = re.compile(r"Sending process (\d+) closing signal SIGTERM")
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)

# (attempt 0.., local rank that failed first, its exit code, ranks found hung) -> one line
Describe = Callable[[int, int, int, list[int]], str]


def _proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _rank_of(pid: int) -> int | None:
    """The RANK a rank process was started with (None: unreadable)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "")
    return int(rank) if rank.isdigit() else None


class TorchrunWatch:
    """Copy torchrun's stderr into ``log`` as it comes, and act on it ([Note: a restart in the
    log]); ``failures`` counts the attempts that failed."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, world: int, max_restarts: int,
                 describe: Describe, out: IO[str] | None = None) -> None:
        self.proc, self.log, self.world, self.max_restarts = proc, log, world, max_restarts
        self.describe, self.out = describe, out or sys.stderr
        self.failures = 0
        self.stopped: list[int] = []  # ranks of this attempt found stopped (hung) and continued
        self.thread = threading.Thread(target=self._read, name="autopipe-torchrun-log", daemon=True)

    def start(self) -> TorchrunWatch:
        self.thread.start()
        return self

    def join(self) -> None:
        self.thread.join()

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with open(self.log, "w", encoding="utf-8") as log:
            for raw in self.proc.stderr:
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                closing = _CLOSING.search(line)
                if closing:
                    self._continue_if_stopped(int(closing.group(1)))
                failed = _FAILED.search(line)
                if failed:
                    self._failed(int(failed.group(2)), int(failed.group(1)))

    def _continue_if_stopped(self, pid: int, wait_s: float = 2.0) -> None:
        """SIGCONT for ``pid`` if it is this torchrun's child, stopped, with SIGTERM pending."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:  # the line comes just before torchrun's signal
            status = _proc_status(pid)
            if not status or status.get("PPid", "").strip() != str(self.proc.pid):
                return
            if not status.get("State", "").startswith("T"):
                return
            if int(status.get("ShdPnd", "0"), 16) & _SIGTERM_BIT:
                rank = _rank_of(pid)
                os.kill(pid, signal.SIGCONT)
                if rank is not None:
                    self.stopped.append(rank)
                who = "a rank" if rank is None else f"rank {rank}"
                self._say(f"autopipe run: {who} (pid {pid}) was stopped (SIGSTOP, or hung in state T) "
                          "when torchrun sent it SIGTERM: continued it so that it ends now, not at "
                          "torchrun's SIGKILL 30 s later")
                return
            time.sleep(0.02)

    def _failed(self, local_rank: int, code: int) -> None:
        self.failures += 1
        hung, self.stopped = self.stopped, []
        if self.failures > self.max_restarts:
            return  # the last attempt: the launcher raises its one line
        line = self.describe(self.failures - 1, local_rank, code, hung)
        self._say(f"autopipe run: attempt {self.failures} of {self.max_restarts + 1} failed: {line}; "
                  f"torchrun restarts all {self.world} ranks (restart {self.failures} of --max-restarts "
                  f"{self.max_restarts})")
