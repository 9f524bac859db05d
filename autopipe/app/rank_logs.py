"""What the ranks of ``autopipe run`` and torchrun wrote: each rank's log collected, their
failures read back as ONE line, and torchrun's stderr watched while it runs.

[Note: one line from K ranks] A failing pipeline makes every rank and torchrun itself print a
traceback (41-168 lines for two ranks). The ranks' stderr and torchrun's own go to files in a
log directory instead (``--redirects 2`` keeps the ranks' stdout, the losses, on the
terminal), and the launcher reads them back: a rank's one-line error (rank_main prints one per
AutopipeError / ExecutorError), the ``PipelineFailure`` of a rank whose peer died or hung, and
torchrun's "root cause" (which rank exited first, with which code or signal) become ONE line
naming the rank, the peer and the step, with the log directory; the status is 2.

[Note: a restart in the log] With ``--max-restarts N`` torchrun's elastic agent restarts every
rank after one fails, without a word on its stderr but the failure
(``failed (exitcode: C) local_rank: R``, logged once the whole group is down). :class:`TorchrunWatch`
reads torchrun's stderr line by line as it is written (into ``torchrun.log``) and, for each
failed attempt that torchrun will restart, prints that attempt's one line (:func:`diagnose`
over the attempt's own logs) and the restart; the restarted rank 0 then prints where the run
resumed and which steps it runs again ([Note: resuming a run] in run_checkpoints.py). A rank
that is stopped (SIGSTOP, a debugger's stop: a hang that SIGTERM cannot end) when torchrun
sends the group SIGTERM would hold the restart for torchrun's 30 s before its SIGKILL; the watch
sends such a rank, and only a child of this torchrun in state T with that SIGTERM pending,
SIGCONT, so that the SIGTERM ends it at once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = ["collect", "echo_warnings", "diagnose", "TorchrunWatch"]


def collect(ranks_dir: Path, work: Path, world: int) -> dict[int, str]:
    """Each rank's stderr, copied to ``work/rankN.log`` (torchrun nests it in run/attempt dirs)."""
    logs: dict[int, str] = {}
    for path in sorted(ranks_dir.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime):
        if path.parent.name.isdigit():
            logs[int(path.parent.name)] = path.read_text(encoding="utf-8", errors="replace")
    for rank in range(world):
        (work / f"rank{rank}.log").write_text(logs.get(rank, ""), encoding="utf-8")
    return logs


def echo_warnings(logs: dict[int, str], work: Path, most: int = 8) -> None:
    """A successful run's stderr lines (warnings), each once, at most ``most`` of them."""
    seen: list[str] = []
    for rank in sorted(logs):
        for line in logs[rank].splitlines():
            if line.strip() and line not in seen:
                seen.append(line)
    for line in seen[:most]:
        print(line, file=sys.stderr)
    if len(seen) > most:
        print(f"autopipe run: {len(seen) - most} more line(s) of the ranks' stderr in {work}", file=sys.stderr)


@dataclass(frozen=True)
class _Exit:
    rank: int
    code: int


_RANK_ERROR = re.compile(r"^autopipe run: error on rank (\d+)(?: at step (\d+))?: (.*)$", re.M)
_PIPELINE_FAILURE = re.compile(
    r"^PipelineFailure: rank (\d+)/\d+(?: \([^)]*\))?: pipeline step (\d+) \(([^,]+),[^)]*\) failed: .*?\((.*)\); "
    r"see that rank's log$", re.M)
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _last_error(text: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback."""
    hits = re.findall(r"^(\w+(?:\.\w+)*(?:Error|Exception|Failure|Interrupt)\b.*)$", text, re.M)
    return hits[-1].strip()[:300] if hits else None


def _short(cause: str) -> str:
    """gloo's cause without its source location and advice: ``Connection closed by peer [addr]``."""
    cause = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", cause)
    return cause.split(". This is typically", 1)[0].strip()


def diagnose(logs: dict[int, str], torchrun_log: str, world: int, work: Path,
             first: tuple[int, int] | None = None, hung: Sequence[int] = (),
             rank_log: Callable[[int], Path] | None = None) -> str:
    """ONE line from the ranks' stderr and torchrun's: which rank failed, at which step, which
    peer died or hung when that is known, and where the logs are ([Note: one line from K ranks]).
    ``first``: the (rank, exit code) that failed first, else read from torchrun's root cause;
    ``hung``: ranks known to have hung; ``rank_log``: where rank R's log is (``work/rankR.log``)."""
    where = f"the ranks' logs are in {work}"
    rank_log = rank_log or (lambda r: work / f"rank{r}.log")
    root = _ROOT.search(torchrun_log)
    if first is None and root:
        first = (int(root.group(1)), int(root.group(2)))
    exited = _Exit(*first) if first is not None else None
    errors = {int(m.group(1)): m for text in logs.values() for m in _RANK_ERROR.finditer(text)}
    if errors:  # a rank's own one-line error: bad input or a runtime check, the root cause
        rank = exited.rank if exited is not None and exited.rank in errors else min(errors)
        m = errors[rank]
        at = f" at step {m.group(2)}" if m.group(2) else " while building its stage"
        return f"rank {rank}{at}: {m.group(3)}; {where}"
    failures = {int(m.group(1)): m for text in logs.values() for m in _PIPELINE_FAILURE.finditer(text)}
    if failures:
        rank = min(failures)
        m = failures[rank]
        peer = ""
        if hung:
            peer = f"its peer rank {hung[0]} hung" if len(hung) == 1 else f"ranks {', '.join(map(str, hung))} hung"
        elif exited is not None and exited.rank not in failures:
            peer = f"its peer rank {exited.rank} {_exit_text(exited.code)}"
        elif world == 2:
            peer = f"its peer rank {1 - rank} died or hung"
        cause = peer or f"a peer rank died or hung ({_short(m.group(4))})"
        return (f"rank {rank} stopped at pipeline step {m.group(2)} ({m.group(3)}): {cause}; {where}")
    if exited is not None:
        text = logs.get(exited.rank, "")
        last = _last_error(text)
        why = f": {last}" if last else ""
        return f"rank {exited.rank} {_exit_text(exited.code)}{why}; its log is {rank_log(exited.rank)}"
    last = _last_error(torchrun_log)
    return f"torchrun failed{': ' + last if last else ''}; its log is {work / 'torchrun.log'}"


_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_CLOSING = re.compile(r"Sending process (\d+) closing signal SIGTERM")
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def attempt_logs(ranks_dir: Path, attempt: int) -> tuple[dict[int, str], Path]:
    """Each rank's stderr in torchrun's ``attempt`` (0: the first run), and the attempt's folder."""
    logs, folder = {}, ranks_dir
    for path in ranks_dir.glob(f"*/attempt_{attempt}/*/stderr.log"):
        if path.parent.name.isdigit():
            logs[int(path.parent.name)] = path.read_text(encoding="utf-8", errors="replace")
            folder = path.parent.parent
    return logs, folder


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
    log]): a failed attempt's line and restart, a stopped rank continued into torchrun's SIGTERM."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, ranks_dir: Path, work: Path, world: int,
                 max_restarts: int, out: IO[str] | None = None) -> None:
        self.proc, self.log, self.ranks_dir, self.work = proc, log, ranks_dir, work
        self.world, self.max_restarts, self.out = world, max_restarts, out or sys.stderr
        self.failures = 0  # attempts that failed
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

    def _failed(self, rank: int, code: int) -> None:
        self.failures += 1
        if self.failures > self.max_restarts:
            return  # the last attempt: run() raises its one line
        logs, folder = attempt_logs(self.ranks_dir, self.failures - 1)
        hung, self.stopped = self.stopped, []
        line = diagnose(logs, "", self.world, folder, first=(rank, code), hung=hung,
                        rank_log=lambda r: folder / str(r) / "stderr.log")
        self._say(f"autopipe run: attempt {self.failures} of {self.max_restarts + 1} failed: {line}; "
                  f"torchrun restarts all {self.world} ranks (restart {self.failures} of --max-restarts "
                  f"{self.max_restarts})")
