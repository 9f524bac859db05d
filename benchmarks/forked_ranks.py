"""The benchmarks' ranks: processes forked from one server that imported torch and autopipe once.

A rank started with 'spawn' is a new interpreter that imports torch, torch.distributed.pipelining
(torch._dynamo) and autopipe again: 3-4 s of CPU per rank, more than a short 2-rank run measures
on a 2-core machine, and paid by every configuration a benchmark runs. :func:`start_ranks` starts
them with 'forkserver' instead: the server (one per process that runs benchmarks, started on
first use) imports ``PRELOAD`` and the module of the rank's function once, and each rank is a fork
of it. A rank is a process of its own from its first instruction, as a spawned one is (its own
memory, process group and threads: every benchmark's rank entry sets its thread count), but it
sees the environment of the server's start, not of the call: pass what a rank needs as
arguments. A server already running in the process (tests/forked.py's, under the test suite)
keeps the modules it was started with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import start_processes

__all__ = ["PRELOAD", "start_ranks"]

PRELOAD = ["autopipe.assemble.ranks", "autopipe.frontend.profiling.profiler"]  # torch, pipelining, autopipe


def start_ranks(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """``start_processes(fn, args, nprocs)``: ``fn(i, *args)`` in ``nprocs`` forked processes,
    joined; raises as start_processes does when one fails."""
    own = [] if fn.__module__ == "__main__" else [fn.__module__]  # a script's: found again by path
    mp.get_context("forkserver").set_forkserver_preload([*PRELOAD, *own])
    start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
