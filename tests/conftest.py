from __future__ import annotations

import gc
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from autopipe.app._startup import collector_paused


def skip_if_no_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """A CUDA test: marked ``cuda`` (``pytest -m cuda`` runs just these, as
    benchmarks/gpu_check.sh does) and skipped cleanly on a machine without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))

# Keep the suite fast and deterministic on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed() -> Iterator[int]:
    """Seed every RNG before each test so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield 0


@pytest.hookimpl(hookwrapper=True)
def pytest_collection() -> Iterator[None]:
    """The test modules' imports (torch, transformers, autopipe) with the cyclic collector
    paused, then frozen: each worker collects sooner, and no later collection walks them
    ([Note: a rank's imports without the collector] in autopipe/app/_startup.py)."""
    with collector_paused():
        yield
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.xdist_order import slow_files_first

    slow_files_first(items)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown (and unused) under -p no:xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per core, at most 4. Many tests start ranks of their own (2-4
    processes each) and a few compare timings or peak memory; more workers than that
    oversubscribe the cores, and those tests measure the load rather than the code.
    PYTEST_XDIST_AUTO_NUM_WORKERS, where set, still decides (xdist's own hook reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (pyproject's addopts) in collection order: [Note: slow files first]."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for what was asked
    from tests.xdist_order import CollectionOrder

    return CollectionOrder(config, log)


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_stay_in_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Everything the suite's processes make with ``tempfile`` (``autopipe run``'s and
    ``autopipe comm``'s default log folders above all) goes under pytest's own temporary folder,
    which pytest prunes, instead of piling up in /tmp. Child processes inherit TMPDIR."""
    folder = tmp_path_factory.mktemp("tempfile")
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(folder))
    mp.setattr(tempfile, "tempdir", str(folder))
    yield
    mp.undo()
