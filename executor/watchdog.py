"""One watchdog thread for every pipeline step of the process, armed and disarmed without a thread.

[Note: one watchdog thread] A distributed step is guarded against a hung peer ([Note: a dead
rank is an error, not a hang] in executor/distributed.py) by a deadline. Starting a
``threading.Timer`` per step costs a thread start and a handshake with it every step (a few
tenths of a millisecond on a loaded CPU, where a small pipeline's step is a few milliseconds).
Here one daemon thread serves every arming: :func:`armed` records a deadline and its action
under a lock, and wakes the thread only when it sleeps towards a later deadline or none. In the
steady state of back-to-back steps the thread sleeps towards an old deadline, wakes once per
``limit``, finds a later one and sleeps again: arming and disarming a step cost a lock each.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["armed"]


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
