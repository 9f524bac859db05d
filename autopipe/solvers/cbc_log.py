"""CBC's log, read while CBC writes it: the ILP's incumbent, bound and gap as they improve.

    log = run_cbc(prob, time_limit=60, gap=0.005, warm_start=True, on_progress=print)
    log.incumbent, log.bound, log.stopped_on_time      # the solve's last word, parsed

:func:`run_cbc` solves a PuLP problem with the CBC binary bundled with PuLP and parses its log
(:class:`CbcLog`) line by line. With ``on_progress`` it calls back with a
:class:`SolverProgress` whenever the best split found (the incumbent) or the proven lower bound
improves, and about every half second in between; :class:`ProgressLine` shows those as one
tqdm line on stderr ([Note: progress on a terminal] in autopipe.frontend.profiling.profiler).

[Note: CBC's log through a pseudo-terminal] CBC prints with C stdio, which buffers 4 KiB at a
time when stdout is a file or a pipe, so tailing a log file shows nothing of a hard solve for
seconds to minutes and then a burst. PuLP (3.3) offers nothing better for CBC: ``msg=True``
passes the same raw log to our stdout (hundreds of lines, unparsed), ``logPath`` writes the
buffered file, and there is no callback. On POSIX systems CBC's stdout is therefore the slave
end of a pseudo-terminal, where stdio flushes every line, and a thread reads the master end:
each line is parsed the moment CBC prints it. PuLP opens the log through its solver's
``get_pipe()``; :class:`_TerminalCbc` returns the terminal there. Without ``on_progress``, or
without ``os.openpty`` (Windows), the log goes to a file and is parsed after the solve: the
result is the same, only not live.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import pulp
from tqdm import tqdm

__all__ = ["SolverProgress", "CbcLog", "run_cbc", "ProgressLine"]

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_NO_SOLUTION = 1e49  # CBC prints 1e+50 as the "best solution" before it has one
_REPRINT = 1e-6  # relative: an incumbent this close to the last one is the same, more exactly
_TICK_S = 0.5  # at most this long between two progress calls while CBC is quiet


@dataclass(frozen=True)
class SolverProgress:
    """The ILP solve at one moment: times in ms of the bottleneck stage, as the ILP minimises."""

    seconds: float  # since the solve started (wall clock)
    incumbent: float | None  # the best split found so far; None before the first
    bound: float | None  # no split can beat this (proven so far); None before the first LP
    nodes: int  # branch-and-bound nodes explored

    @property
    def gap(self) -> float | None:
        """``(incumbent - bound) / incumbent``: how far from proven optimal the incumbent may be."""
        if self.incumbent is None or self.bound is None or self.incumbent <= 0:
            return None
        return max(0.0, (self.incumbent - self.bound) / self.incumbent)

    def describe(self) -> str:
        """``best 46.64 ms, bound 44.87 ms, gap 3.8%, 110 nodes``."""
        best = "none yet" if self.incumbent is None else f"{self.incumbent:.4g} ms"
        bound = "-" if self.bound is None else f"{self.bound:.4g} ms"
        gap = "" if self.gap is None else f", gap {100 * self.gap:.1f}%"
        return f"best {best}, bound {bound}{gap}, {self.nodes:,} nodes"


# Each pattern of CBC 2.10's log: (regex, what its numbers are).
_PATTERNS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(regex), fields) for regex, fields in (
        (rf"^Continuous objective value is {_NUM}", ("bound",)),
        (rf"^Cbc0045I MIPStart provided solution with cost {_NUM}", ("incumbent",)),
        (rf"Integer solution of {_NUM} found", ("incumbent",)),  # Cbc0004I, Cbc0012I, Cbc0016I
        (rf"^Cbc0013I At root node, .* to {_NUM} in", ("bound",)),
        (rf"^Cbc0010I After (\d+) nodes, \d+ on tree, {_NUM} best solution, best possible {_NUM}",
         ("nodes", "incumbent", "bound")),
        (rf"^Cbc0005I Partial search - best objective {_NUM} \(best possible {_NUM}\), "
         rf"took \d+ iterations and (\d+) nodes", ("incumbent", "bound", "nodes")),
        (rf"^Cbc0001I Search completed - best objective {_NUM}, took \d+ iterations and (\d+) nodes",
         ("incumbent", "nodes", "proven")),
        (rf"^Cbc0011I Exiting as integer gap of {_NUM}", ("abs_gap",)),
        (r"^Result - Optimal solution found \(within gap tolerance\)", ("within_gap",)),
        (r"^Result - Optimal solution found\s*$", ("proven",)),
        (r"^(Cbc0020I Exiting on maximum time|Result - Stopped on time limit)", ("time_limit",)),
        (rf"^Objective value:\s+{_NUM}", ("incumbent",)),  # (its "Lower bound:" has 3 decimals)
    )
)


class CbcLog:
    """CBC's log, fed one line at a time: the incumbent only falls, the bound only rises.

    ``gap`` is the relative gap the solve was asked for: CBC stops once the incumbent is within
    it, and that proves ``bound >= incumbent x (1 - gap)``.
    """

    def __init__(self, gap: float = 0.0) -> None:
        self.gap = gap
        self.lines: list[str] = []
        self.incumbent: float | None = None
        self._bound: float | None = None
        self.nodes = 0
        self.stopped_on_time = False
        self.error: str | None = None  # CBC failed (PuLP's PulpSolverError): its first line
        self._exact = False  # CBC proved the incumbent optimal ...
        self._within_gap = False  # ... or within the relative gap asked for
        self._abs_gap: float | None = None  # ... or within this many ms
        self._lock = threading.Lock()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def bound(self) -> float | None:
        """The best proven lower bound, never above the incumbent."""
        bound, best = self._bound, self.incumbent
        if best is None:
            return bound
        if self._abs_gap is not None:  # stopped within the gap: best - bound <= abs_gap
            bound = _max(bound, best - self._abs_gap)
        elif self._within_gap:
            bound = _max(bound, best * (1 - self.gap))
        elif self._exact:
            bound = best
        return None if bound is None else min(bound, best)

    def feed(self, line: str) -> None:
        """Read one line of the log."""
        with self._lock:
            self.lines.append(line)
            for pattern, fields in _PATTERNS:
                found = pattern.search(line)
                if found is None:
                    continue
                numbers = iter(found.groups())
                for name in fields:
                    self._take(name, numbers)

    def _take(self, name: str, numbers: Any) -> None:
        if name == "incumbent":
            value = float(next(numbers))
            # the same split reprinted with more digits (CBC rounds some lines to 7) replaces it
            if abs(value) < _NO_SOLUTION and (self.incumbent is None or value <= self.incumbent
                                              + _REPRINT * max(1.0, abs(self.incumbent))):
                self.incumbent = value
        elif name == "bound":
            self._bound = _max(self._bound, float(next(numbers)))
        elif name == "nodes":
            self.nodes = max(self.nodes, int(next(numbers)))
        elif name == "abs_gap":
            self._abs_gap = float(next(numbers))
        elif name == "proven":
            self._exact = True
        elif name == "within_gap":
            self._within_gap = True
        elif name == "time_limit":
            self.stopped_on_time = True

    def state(self, seconds: float) -> SolverProgress:
        with self._lock:
            return SolverProgress(seconds, self.incumbent, self.bound, self.nodes)


def _max(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


class _TerminalCbc(pulp.PULP_CBC_CMD):  # type: ignore[misc]
    """PuLP's bundled CBC printing to ``pipe`` (see [Note: CBC's log through a pseudo-terminal])."""

    def __init__(self, pipe: IO[str], **options: Any) -> None:
        super().__init__(**options)
        self._pipe = pipe

    def get_pipe(self) -> IO[str]:
        return self._pipe


def run_cbc(
    prob: pulp.LpProblem,
    *,
    time_limit: float,
    gap: float,
    warm_start: bool,
    threads: int | None = None,
    on_progress: Callable[[SolverProgress], None] | None = None,
) -> CbcLog:
    """Solve ``prob`` with CBC; its log parsed, live when ``on_progress`` is given.

    ``on_progress`` runs on a reader thread each time the incumbent, the bound or the node
    count changes, at least every half second, and once more (on the caller's thread) at the end.
    """
    log = CbcLog(gap)
    options: dict[str, Any] = dict(msg=False, timeLimit=max(1, int(math.ceil(time_limit))),
                                   gapRel=gap, warmStart=warm_start, threads=threads)
    start = time.perf_counter()
    try:
        if on_progress is not None and hasattr(os, "openpty"):
            _solve_live(prob, options, log, lambda: on_progress(log.state(time.perf_counter() - start)))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "cbc.log")
                try:
                    prob.solve(pulp.PULP_CBC_CMD(logPath=path, **options))
                finally:
                    if os.path.exists(path):
                        with open(path, encoding="utf-8", errors="replace") as f:
                            for line in f:
                                log.feed(line.rstrip("\r\n"))
    except pulp.PulpSolverError as err:  # CBC did not run, or left no solution: the status says not solved
        log.error = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if on_progress is not None:
        on_progress(log.state(time.perf_counter() - start))
    return log


def _solve_live(prob: pulp.LpProblem, options: dict[str, Any], log: CbcLog,
                report: Callable[[], None]) -> None:
    master, slave = os.openpty()
    out = os.fdopen(slave, "w")  # PuLP closes it once CBC has exited: the reader then sees EOF
    reader = threading.Thread(target=_pump, args=(master, log, report), daemon=True,
                              name="autopipe-cbc-log")
    reader.start()
    try:
        prob.solve(_TerminalCbc(out, **options))
    finally:
        out.close()
        reader.join(timeout=30)
        os.close(master)


def _pump(fd: int, log: CbcLog, report: Callable[[], None]) -> None:
    """Feed every line CBC prints to ``log``; report on changes and every ``_TICK_S``."""
    pending = b""
    shown: tuple[Any, ...] | None = None
    last = time.perf_counter()
    with selectors.DefaultSelector() as selector:  # poll/epoll: no FD_SETSIZE limit
        selector.register(fd, selectors.EVENT_READ)
        while True:
            if selector.select(_TICK_S):
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:  # EIO: every writer of the terminal has closed it
                    chunk = b""
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    log.feed(line.decode("utf-8", "replace").rstrip("\r"))
            key = (log.incumbent, log.bound, log.nodes)
            if key != shown or time.perf_counter() - last >= _TICK_S:
                shown, last = key, time.perf_counter()
                report()
    if pending:
        log.feed(pending.decode("utf-8", "replace").rstrip("\r"))


class ProgressLine:
    """The ILP's progress as one line on stderr: seconds against the time limit, best, bound,
    gap. ``progress``: None shows it when stderr is a terminal, True always, False never."""

    def __init__(self, time_limit: float, progress: bool | None) -> None:
        self._bar = tqdm(total=max(1, int(math.ceil(time_limit))), desc="ilp", file=sys.stderr,
                         disable=None if progress is None else not progress, leave=False,
                         bar_format="{desc}: {bar:12} {n:.0f}/{total} s{postfix}")

    @property
    def enabled(self) -> bool:
        return not self._bar.disable

    def __call__(self, state: SolverProgress) -> None:
        self._bar.n = min(state.seconds, float(self._bar.total))
        self._bar.set_postfix_str(state.describe(), refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
