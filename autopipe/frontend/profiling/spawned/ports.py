"""A TCP port for a process group's rendezvous on this host, out of the kernel's ephemeral range.

    port = free_port()
    dist.init_process_group("gloo", ..., init_method=f"tcp://127.0.0.1:{port}")

[Note: a rendezvous port] Binding port 0 and closing gives a port free at that instant, taken
from the ephemeral range, the same range every outgoing connection's local port comes from
(gloo's pairs, a store client): between the close and the store's listen another process's
connection can take it, and the store fails with EADDRINUSE (seen in CI, once in ~20 runs with
two test workers starting ranks). A port below the ephemeral range is never handed out that
way, so only another explicit bind can take it; this picks one at random (a generator of its
own: the caller's ``random`` state is untouched) and checks it binds.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 10_000  # ports below the ephemeral range to pick from
_TRIES = 64
_PICK = random.Random()  # its own state, seeded from the OS


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _below_ephemeral() -> range | None:
    try:
        low = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or no /proc: the OS's own choice below
    return range(max(1024, low - _SPAN), low) if low > 2048 else None


def free_port() -> int:
    """A port of 127.0.0.1 free now and outside the ephemeral range where the host says what
    that range is ([Note: a rendezvous port]); else one the OS picks."""
    ports = _below_ephemeral()
    if ports is not None:
        for _ in range(_TRIES):
            port = _PICK.choice(ports)
            if _binds(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
