"""Test code in processes of their own, forked from one server that imported torch and autopipe.

[Note: processes forked from a server] A test that needs a process of its own (a rank, or a
memory measurement that must see only what it allocates: [Note: RssAnon]) used to start a new
interpreter ('spawn', ``python -c``), which imports torch, torch.distributed.pipelining
(torch._dynamo) and autopipe again: 3-4 s of CPU each on the suite's 2 cores. These are
'forkserver' processes instead: one server, started on first use, imports ``PRELOAD`` once (torch,
autopipe, and what a test's first HuggingFace model and first torch.export would import), and
each process is a fork of it. It is a process of its own from its first instruction, as a
spawned one is: its own memory (the server's pages are its baseline, as a fresh interpreter's
imports are), its own process group, killed alone. The server runs nothing, so a child starts
from the state imports leave: no thread pools, no allocations freed, and torch's default seed,
re-set in the child as a fresh process has it. Unlike 'spawn', a child sees the environment of
the server's start, not the test's: a test that sets the environment for its child (an allocator
variable, LD_PRELOAD) still starts a new interpreter.

A test of code that spawns its own processes (autopipe's ``measure_comm``, two fresh
interpreters per launch, ~4 s of CPU each here) forks them from the same server instead with
:func:`start_processes`, where what they run, not how a process starts, is under test (the
spawned start has its own tests: tests/frontend/profiling/spawned/test_comm.py).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["PRELOAD", "Child", "context", "start", "start_processes"]

PRELOAD = [
    "autopipe.assemble.ranks", "autopipe.frontend.profiling.profiler",  # torch, pipelining, autopipe
    # what a child's first HuggingFace model and first torch.export import (~4.5 s of CPU, ~60 MB):
    # the families the tests build from configs ([Note: processes forked from a server]); a name
    # that does not import is skipped by the server
    "torch.export._trace", "torch._functorch.aot_autograd",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "llama", "mistral", "qwen2", "bert", "t5", "mamba")),
]


def context() -> Any:
    """The 'forkserver' context whose server imports ``PRELOAD`` (read when it starts: once),
    through tests/forked_preload.py."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.forked_preload"])
    return ctx


def fresh_state() -> None:
    """What a new interpreter has that a fork of the server does not: torch's default seed."""
    torch.manual_seed(torch.initial_seed())


def _run(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    fresh_state()
    try:
        conn.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        conn.send((False, traceback.format_exc()))
        os._exit(1)


class Child:
    """``fn(*args)`` running in a forked process: :meth:`result` waits for what it returned."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        ctx = context()
        self._conn, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_run, args=(child, fn, args), daemon=True)
        self.process.start()
        child.close()

    def result(self, timeout: float) -> Any:
        """``fn``'s return value; AssertionError with its traceback if it raised, died or did
        not finish within ``timeout`` seconds (then it is killed)."""
        try:
            if not self._conn.poll(timeout):
                raise AssertionError(f"{self.process.name} did not finish within {timeout:.0f} s")
            ok, value = self._conn.recv()
        except EOFError:
            self.process.join()
            raise AssertionError(f"{self.process.name} died (exit code {self.process.exitcode})") from None
        finally:
            self.process.join(10)  # it has answered: only its exit is left
            self.kill()
        if not ok:
            raise AssertionError(value)
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def start(fn: Callable[..., Any], *args: Any) -> Child:
    """Run ``fn(*args)`` in a process of its own ([Note: processes forked from a server])."""
    return Child(fn, *args)


def start_processes(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True,
                    daemon: bool = False, start_method: str = "spawn") -> Any:
    """``torch.multiprocessing.start_processes`` whose processes are forks of the server
    ([Note: processes forked from a server]) whatever ``start_method`` says: patched in for
    the function a module calls (``monkeypatch.setattr(comm, "start_processes", ...)``)."""
    from torch.multiprocessing.spawn import start_processes as start

    context()  # the server's preload, should this be its first use
    return start(fn, args=args, nprocs=nprocs, join=join, daemon=daemon, start_method="forkserver")
