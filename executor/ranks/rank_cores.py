"""Which CPU cores a rank runs on when several ranks of a pipeline share one host.

    cores = pin_local_rank()   # first thing in a rank: before its process group and threads

[Note: ranks pinned to cores] Ranks on one host that are left to the OS scheduler share all of
its cores: each rank's compute thread, gloo's I/O thread and the Python around them move
between cores, and two ranks' compute threads land on one core for a while. The cost shows in
posting messages: gloo's I/O thread (``gloo_tcp_loop``) handles every message and rendezvous
notice, and while it runs the posting thread waits; unpinned, it lands on the other rank's core
and a post that alone takes a small fraction of a millisecond can hold a small step for
milliseconds, in some launches and not others. Pinned, it shares its own rank's core. An
empty pipeline, which is nothing but such messages, still pays it in some launches, pinned or
not: the likely reason the call cost fitted on one ([Note: measured transfer] in
autopipe/frontend/profiling/spawned/comm.py) takes one of two values. Every thread is pinned,
not only the rank's compute thread: pinning that one alone measured no better. Measured:
docs/benchmarks.md, "The runtime's own cost"; the A/B runs behind this Note are in
CHANGELOG.md, "Ranks are pinned to a core each".

Local rank r of n takes the r-th of n equal, disjoint runs of the cores this process may use
(its affinity mask: a container's or ``taskset``'s cores, not the machine's), and every thread
it has or starts runs there. With fewer cores than ranks nothing is pinned (the ranks share
cores however they are placed). CPU ranks only: ``autopipe run`` (unless ``--no-pin-cores``),
``autopipe profile --comm``'s two measuring ranks and the twin that measures [Note: ranks
sharing a host] run pinned, so the profile predicts pinned ranks; a script that starts its own
ranks under torchrun calls :func:`pin_local_rank` first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

__all__ = ["local_cores", "pin_local_rank", "pin_threads"]


def local_cores(local_rank: int, local_world_size: int, available: Iterable[int]) -> list[int] | None:
    """The cores of local rank ``local_rank`` of ``local_world_size`` on a host whose usable
    cores are ``available``: the rank's run of ``len(available) // local_world_size`` of them,
    in ascending order; None for one rank, or fewer cores than ranks."""
    cores = sorted(set(available))
    if local_world_size < 2 or not 0 <= local_rank < local_world_size or len(cores) < local_world_size:
        return None
    per = len(cores) // local_world_size
    return cores[local_rank * per:(local_rank + 1) * per]


def pin_threads(cores: Sequence[int]) -> None:
    """Every thread of this process onto ``cores``; threads it starts later inherit them."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile, or not ours to move
            continue


def pin_local_rank(local_rank: int | None = None, local_world_size: int | None = None) -> list[int] | None:
    """Pin this process to its share of the host's cores ([Note: ranks pinned to cores]); the
    rank and the number of ranks on this host default to torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``. Returns the cores, or None where nothing was pinned (one rank, fewer
    cores than ranks, or a platform without CPU affinity)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world_size is None else local_world_size
    cores = local_cores(rank, world, os.sched_getaffinity(0))
    if cores is not None:
        pin_threads(cores)
    return cores
