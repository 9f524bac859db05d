"""One watchdog thread for every pipeline step of the process, armed and disarmed without a thread.

[Note: one watchdog thread] A distributed step is guarded against a hung peer ([Note: a dead
rank is an error, not a hang] in executor/ranks/distributed.py) by a deadline. Starting a
``threading.Timer`` per step costs a thread start and a handshake with it every step (a few
tenths of a millisecond on a loaded CPU, where a small pipeline's step is a few milliseconds).
Here one daemon thread serves every arming: :func:`armed` records a deadline and its action
under a lock, and wakes the thread only when it sleeps towards a later deadline or none. In the
steady state of back-to-back steps the thread sleeps towards an old deadline, wakes once per
``limit``, finds a later one and sleeps again: arming and disarming a step cost a lock each.

[Note: the first step's own limit] A pipeline's first step does what no later step does: it
builds torch's schedule and stages, runs the first forward through every lazy initialiser and
(under torch.compile or on a GPU) compiles and warms up, so a first step may take minutes where
the steady state takes milliseconds. As torchtitan gives initialisation its own timeout,
:class:`StepLimits` gives the first guarded step ``first_step_timeout`` (default
:data:`FIRST_STEP_TIMEOUT_S`) and every later one ``timeout``. The pipeline's process groups
are created with the longer of the two and shortened to ``timeout`` once the first step is
through (``executor._torch_compat.set_group_timeout``); where torch cannot shorten them, the
watchdog alone bounds the later steps. ``timeout=None`` turns the watchdog off and leaves the
groups at torch's default timeout.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from executor._torch_compat import set_group_timeout
from executor.errors import DistributedError

__all__ = ["FIRST_STEP_TIMEOUT_S", "GRACE_S", "WATCHDOG_EXIT_CODE", "StepLimits", "StepWatch", "armed"]

WATCHDOG_EXIT_CODE = 3
GRACE_S = 5.0

FIRST_STEP_TIMEOUT_S = 600.0


def _seconds(value: float | None, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DistributedError(f"{name}={value!r} must be a number of seconds > 0 (or None: "
                               f"no limit), e.g. {name}=60")


@dataclass(frozen=True)
class StepLimits:
    """How long a pipeline step may run before the watchdog ends the process ([Note: the first
    step's own limit]); None: no limit."""

    timeout: float | None = 60.0
    first_step_timeout: float | None = FIRST_STEP_TIMEOUT_S

    def __post_init__(self) -> None:
        _seconds(self.timeout, "timeout")
        _seconds(self.first_step_timeout, "first_step_timeout")

    def step_limit(self, first: bool) -> float | None:
        """Seconds the first (``first``) or a later step may take; None when unguarded."""
        if self.timeout is None:
            return None
        if first and self.first_step_timeout is not None:
            return max(self.timeout, self.first_step_timeout)
        return self.timeout

    @property
    def group_timeout(self) -> datetime.timedelta | None:
        """The process groups' timeout until the first step is through (None: torch's default)."""
        limit = self.step_limit(first=True)
        return None if limit is None else datetime.timedelta(seconds=limit)

    @property
    def steady_group_timeout(self) -> datetime.timedelta | None:
        """The groups' timeout after the first step, where it differs from the first's."""
        if self.timeout is None or self.step_limit(first=True) == self.timeout:
            return None
        return datetime.timedelta(seconds=self.timeout)


class _Watchdog:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.deadlines: dict[int, tuple[float, Callable[[], None]]] = {}  # arming -> deadline, action
        self.tokens = itertools.count()
        self.sleeping_until: float | None = None  # the thread's next wake-up (None: when woken)
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for token in [t for t, (deadline, _) in self.deadlines.items() if deadline <= now]:
                    self.deadlines.pop(token)[1]()  # ends the process (os._exit), as a rule
                until = min((deadline for deadline, _ in self.deadlines.values()), default=None)
                self.sleeping_until = until
                self.lock.wait(None if until is None else until - now)

    def arm(self, deadline: float, action: Callable[[], None]) -> int:
        with self.lock:
            token = next(self.tokens)
            self.deadlines[token] = (deadline, action)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self.run, name="autopipe-watchdog", daemon=True)
                self.thread.start()
            elif self.sleeping_until is None or deadline < self.sleeping_until:
                self.lock.notify()
            return token

    def disarm(self, token: int) -> None:
        with self.lock:
            self.deadlines.pop(token, None)


_watchdog = _Watchdog()


def _after_fork() -> None:  # a forked child has none of the parent's threads
    global _watchdog
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_after_fork)


@contextmanager
def armed(limit: float, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` on the watchdog thread if the block is still running ``limit`` seconds
    after it started ([Note: one watchdog thread]); ``action`` should end the process."""
    watchdog = _watchdog
    token = watchdog.arm(time.monotonic() + limit, action)
    try:
        yield
    finally:
        watchdog.disarm(token)


class StepWatch:
    """Each step of one pipeline under its limit ([Note: the first step's own limit]): past it,
    ``failure(cause)``'s line is printed and the process ends with :data:`WATCHDOG_EXIT_CODE`;
    after the first step, ``groups()`` are shortened to the steady timeout."""

    def __init__(self, limits: StepLimits, failure: Callable[[str], str],
                 groups: Callable[[], list[dist.ProcessGroup]]) -> None:
        self.limits, self._failure, self._groups = limits, failure, groups
        self._first_done = False

    @contextmanager
    def step(self) -> Iterator[None]:
        first = not self._first_done
        limit = self.limits.step_limit(first)
        if limit is None:
            yield
        else:
            def fire() -> None:
                msg = self._failure(f"no progress for {limit + GRACE_S:.0f}s")
                print(f"PipelineFailure: {msg}", file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)

            with armed(limit + GRACE_S, fire):
                yield
        if first:
            self._first_done = True
            steady = self.limits.steady_group_timeout
            if steady is not None:
                for group in self._groups():
                    set_group_timeout(group, steady)
