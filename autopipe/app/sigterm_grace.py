"""A rank's last words before torchrun's SIGTERM ends it ([Note: SIGTERM grace]).

[Note: SIGTERM grace] When one rank dies, torchrun (which polls its ranks every 0.1 s under
`autopipe run`) sends the others SIGTERM. A rank blocked on the dead peer learns of the death
from gloo at the same moment ("Connection closed by peer") and writes its one-line
``PipelineFailure`` (which step, which schedule) to its log; the launcher turns that into the
run's one line. On a loaded host the SIGTERM can come first and, with the default action, ends
the rank before it has written anything, so the report loses the step. Under :func:`install`
a SIGTERM gives the rank ``grace_s`` to finish what it is doing (its report, the process group's
teardown) and then ends it with exit status 128 + SIGTERM, as the default action would; a rank
that ends sooner by itself keeps its own exit status. The deadline holds while the main thread
is blocked inside torch (a receive that never returns, a hung peer): the signal wakes a reader
thread through :func:`signal.set_wakeup_fd`, not the main thread's Python handler, which only
runs between bytecodes.

Process-wide: it sets SIGTERM's handler and the wakeup fd, so only a process's own entry point
calls it (``rank_main``, which torchrun starts), never the library.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

GRACE_S = 2.0
"""How long a rank told to stop may take to write its report: gloo's "connection closed" reaches
a blocked rank within milliseconds of its peer's death, far less on an idle host."""


def install(grace_s: float = GRACE_S) -> threading.Event:
    """From the main thread: SIGTERM ends this process ``grace_s`` after it arrives (status 143).
    Returns an event to set once the process's work is done (it then ends with its own status,
    not 143, and a SIGTERM after that keeps its Python handler: nothing). Where the
    platform lacks what this needs (no SIGTERM, not the main thread), SIGTERM keeps its default."""
    done = threading.Event()
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        return done
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
                if not done.wait(grace_s):  # done in time: the process ends with its own status
                    os._exit(128 + signal.SIGTERM)
                return

    threading.Thread(target=watch, args=(reader, writer), name="autopipe-sigterm-grace", daemon=True).start()
    return done
