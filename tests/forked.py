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
import runpy
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from autopipe.frontend.profiling.spawned import ports

__all__ = ["PRELOAD", "Child", "ScriptRun", "context", "free_port", "run_all", "run_script", "start",
           "start_processes"]

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


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous ([Note: a rendezvous
    port] in autopipe/frontend/profiling/spawned/ports.py)."""
    return ports.free_port()


def run_all(procs: Sequence[Any], timeout: float) -> list[int | None]:
    """Start ``procs``, wait ``timeout`` seconds for them all, kill whatever still runs: each
    one's exit code, None for the killed."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes: list[int | None] = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


@dataclass(frozen=True)
class ScriptRun:
    """What :func:`run_script`'s ranks did: each one's exit code (None: killed at the deadline),
    and their stdout and stderr, rank after rank."""
    exitcodes: list[int | None]
    stdout: str
    stderr: str


def _script_rank(rank: int, world: int, port: int, script: str, argv: list[str], out: str) -> None:
    """One rank of :func:`run_script`: what torchrun gives a rank of a single-node launch (its
    environment, one thread), stdout and stderr into files, then the script as ``__main__``."""
    fresh_state()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                       "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        sys.stdout.flush()
        sys.stderr.flush()
        f = os.open(Path(out, f"{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's stderr, as under torchrun
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(script: str | os.PathLike[str], argv: Sequence[str], *, world: int, timeout: float) -> ScriptRun:
    """A user's training script on ``world`` ranks as ``torchrun --standalone
    --nproc_per_node=WORLD script ARGV`` starts it (its environment, ``env://`` rendezvous on
    this host), each rank a fork of the server ([Note: processes forked from a server]) instead
    of a fresh interpreter: the script, not torchrun, is under test (``autopipe run``'s own
    tests start torchrun)."""
    ctx, port = context(), free_port()
    with tempfile.TemporaryDirectory() as out:
        codes = run_all([ctx.Process(target=_script_rank, args=(r, world, port, str(script), list(argv), out),
                                     daemon=True) for r in range(world)], timeout)

        def read(name: str) -> str:
            return "".join(Path(out, f"{r}.{name}").read_text() if Path(out, f"{r}.{name}").exists() else ""
                           for r in range(world))

        return ScriptRun(codes, read("stdout"), read("stderr"))
