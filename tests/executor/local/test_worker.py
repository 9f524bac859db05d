from __future__ import annotations

import threading

import pytest
import torch

from executor.local.worker import WorkerPool, normalize_device

CPU = torch.device("cpu")


def test_normalize_device() -> None:
    assert normalize_device("cpu:1") == CPU
    assert normalize_device(CPU) == CPU


def test_single_device_runs_inline_in_submission_order() -> None:
    order: list[tuple[int, str]] = []
    with WorkerPool([CPU, CPU]) as pool:
        assert not pool.threaded and pool.num_workers == 0
        futures = [
            pool.submit(j, lambda j=j: order.append((j, threading.current_thread().name)))
            for j in (0, 1, 0)
        ]
        assert all(f.done() for f in futures)
    assert order == [(0, "MainThread"), (1, "MainThread"), (0, "MainThread")]


def test_threads_one_worker_per_distinct_device_fifo() -> None:
    names: list[str] = []
    with WorkerPool([CPU, CPU, CPU], threaded=True) as pool:
        assert pool.num_workers == 1  # stages on one device share a worker
        futures = [
            pool.submit(j, lambda j=j: (names.append(threading.current_thread().name), j)[1])
            for j in range(3)
        ]
        assert [f.result() for f in futures] == [0, 1, 2]
    assert names == ["gpipe-cpu"] * 3


def test_grad_mode_is_carried_into_the_worker() -> None:
    with WorkerPool([CPU], threaded=True) as pool:
        with torch.no_grad():
            off = pool.submit(0, torch.is_grad_enabled)
        on = pool.submit(0, torch.is_grad_enabled)
        assert (off.result(), on.result()) == (False, True)


@pytest.mark.parametrize("threaded", [False, True])
def test_exceptions_come_back_through_the_future(threaded: bool) -> None:
    def fail() -> None:
        raise KeyError("stage failed")

    with WorkerPool([CPU], threaded=threaded) as pool:
        future = pool.submit(0, fail)
        with pytest.raises(KeyError, match="stage failed"):
            future.result()
        assert pool.submit(0, lambda: 5).result() == 5  # the worker survives
