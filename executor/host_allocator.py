"""Freed host memory stays in the process, as CUDA's caching allocator keeps freed device memory.

[Note: freed memory stays in the process] On a CPU, PyTorch allocates tensors with the C
library's malloc. glibc serves a large block (its threshold adapts, up to 32 MiB) by mapping
fresh pages and gives them back to the kernel when the block is freed, and trims the heap's
top once 128 KiB or more are free there; the next tensor of that size then faults in and zeroes
every 4 KiB page again. A training step allocates and frees the same activations every
micro-batch, and a recomputed one twice, so a step of the bundled examples could spend a large
share of its time in page faults, while a layer timed alone over and over reuses its block and
pays none of it: predictions from the profile came out short by all of that time
(benchmarks/executor_vs_prediction.py; the figures: CHANGELOG.md, "Freed host memory stays in
the process", and docs/benchmarks.md, "Figures behind the Notes").

:func:`retain_freed_memory` sets glibc's ``M_MMAP_THRESHOLD`` to its maximum (32 MiB: blocks
up to that come from the heap) and ``M_TRIM_THRESHOLD`` to 2 GiB (freed heap memory is kept
for reuse), once per process; the process keeps its peak resident memory instead of returning
it between steps, which is what a training loop reuses anyway. It cannot be undone, so the
library does it only when asked: ``host_allocator="retain"`` on ``autopipe.profile()``,
``pipeline()`` and ``distributed_pipeline()`` (the command line's default); the library's
default, ``"system"``, leaves the process as it is. The profile records the setting it was
measured under (``meta["host_allocator"]``: the process's state, which an earlier "retain" in
the same process leaves set), and a pipeline that runs under another warns once, in one line,
since its step time then differs from the prediction. It does nothing when the user chose an allocator
(``MALLOC_*`` tunables or ``LD_PRELOAD``, e.g. jemalloc or tcmalloc as PyTorch's CPU
performance guide suggests) or when the C library has no ``mallopt`` (not glibc).
"""

from __future__ import annotations

import ctypes
import os

from executor.errors import ExecutorError

__all__ = ["HOST_ALLOCATORS", "check_host_allocator", "host_allocator_in_use", "retain_freed_memory",
           "use_host_allocator"]

HOST_ALLOCATORS = ("system", "retain")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's limit on 64-bit systems
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
_state: dict[str, bool] = {}


def _user_chose() -> bool:
    """glibc malloc tunables in the environment, or another allocator preloaded."""
    env = os.environ
    return any(k.startswith("MALLOC_") for k in env) or "malloc" in env.get("GLIBC_TUNABLES", "") \
        or "malloc" in env.get("LD_PRELOAD", "")


def retain_freed_memory() -> bool:
    """Keep freed host memory for reuse ([Note: freed memory stays in the process]); True when
    it is set, now or by an earlier call, False when the user's allocator settings or a C
    library without ``mallopt`` leave it alone."""
    if "done" in _state:
        return _state["done"]
    done = False
    if not _user_chose():
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and \
                bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _state["done"] = done
    return done


def host_allocator_in_use() -> str:
    """``"retain"`` once this process keeps freed memory (:func:`retain_freed_memory` took
    effect), else ``"system"``."""
    return "retain" if _state.get("done") else "system"


def check_host_allocator(choice: str) -> None:
    """One line unless ``choice`` is one of :data:`HOST_ALLOCATORS`."""
    if choice not in HOST_ALLOCATORS:
        raise ExecutorError(f"host_allocator={choice!r} is unknown; use 'system' (the process's "
                            "allocator as it is) or 'retain' (glibc keeps freed memory for reuse)")


def use_host_allocator(choice: str) -> str:
    """Apply ``choice`` (one of :data:`HOST_ALLOCATORS`; ``"system"`` changes nothing) and
    return the setting the process runs under afterwards (:func:`host_allocator_in_use`)."""
    check_host_allocator(choice)
    if choice == "retain":
        retain_freed_memory()
    return host_allocator_in_use()
