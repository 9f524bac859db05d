"""A rank's last words before torchrun's SIGTERM ends it ([Note: SIGTERM grace]).

[Note: SIGTERM grace] When one rank dies, torchrun (which polls its ranks every 0.1 s under
`autopipe run`) sends the others SIGTERM. A rank blocked on the dead peer learns of the death
from gloo at the same moment ("Connection closed by peer") and writes its one-line
``PipelineFailure`` (which step, which schedule) to its log; the launcher turns that into the
run's one line. On a loaded host the SIGTERM can come first and, with the default action, ends
the rank before it has written anything, so the report loses the step. Under :func:`install`
a SIGTERM gives the rank ``grace_s`` to finish what it is doing (its report, the process group's
teardown) and ends it once that is done, with the status it decided, or at the deadline with
128 + SIGTERM, as the default action would have at once; it never waits for the interpreter's
shutdown, which can block on what a dead peer left behind. The deadline holds while the main thread
is blocked inside torch (a receive that never returns, a hung peer): the signal wakes a reader
thread through :func:`signal.set_wakeup_fd`, not the main thread's Python handler, which only
runs between bytecodes; and where the main thread holds the GIL all that time, so that the reader
cannot run either, :func:`faulthandler.dump_traceback_later`'s thread, which needs no GIL, writes
every thread's stack to the rank's log half a second later and ends it with status 1.

Process-wide: it sets SIGTERM's handler and the wakeup fd, so only a process's own entry point
calls it (``rank_main``, which torchrun starts), never the library.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading

GRACE_S = 2.0
"""How long a rank told to stop may take to write its report: gloo's "connection closed" reaches
a blocked rank within milliseconds of its peer's death, far less on an idle host."""

BACKSTOP_S = 0.5
"""After the grace, this much longer for the process to end itself before faulthandler's thread
(which needs no GIL) writes every thread's stack to stderr and ends it with status 1."""


class Grace:
    """What :func:`install` returns: :meth:`finish` once the process's work is done."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._status = 128 + signal.SIGTERM if hasattr(signal, "SIGTERM") else 1

    def finish(self, status: int) -> None:
        """The process's work is done and ``status`` decided: a SIGTERM, before or after this
        call, ends the process at once with that status, without waiting for the interpreter's
        shutdown (which may wait on threads that a dead peer left blocked)."""
        self._status = status
        self._done.set()

    def _end_after(self, grace_s: float) -> None:
        # the backstop needs no GIL: a main thread inside torch holding it (seen: a rank stopped
        # and continued mid-step) would keep this thread from ever running again
        faulthandler.dump_traceback_later(grace_s + BACKSTOP_S, exit=True)
        self._done.wait(grace_s)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self._status)


def install(grace_s: float = GRACE_S) -> Grace:
    """From the main thread: SIGTERM ends this process at most ``grace_s`` after it arrives, with
    the status given to :meth:`Grace.finish` if that came in time, else 128 + SIGTERM. Where the
    platform lacks what this needs (no SIGTERM, not the main thread), SIGTERM keeps its default."""
    grace = Grace()
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return grace
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd needs a non-blocking fd
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the reader thread acts on it
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch(reader: socket.socket, writer: socket.socket) -> None:  # both live as long as it does
        while True:
            got = reader.recv(64)
            if not got:  # closed: nothing more to watch
                return
            if signal.SIGTERM in got:
                grace._end_after(grace_s)

    threading.Thread(target=watch, args=(reader, writer), name="autopipe-sigterm-grace", daemon=True).start()
    return grace
