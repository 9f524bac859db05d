"""One worker per device: where the stages' forward computations run.

[Note: inline worker] GPipe's concurrency comes from different devices computing different
micro-batches in the same clock cycle. Work for one device is serial anyway, so when every stage
lives on the same device (all-CPU pipelines, or several stages on one GPU) a thread adds only a
hand-off per task, and loses the caller's thread-local state (saved-tensor hooks, autocast,
profilers). The pool then runs tasks inline, in the caller's thread, in submission order. With
two or more distinct devices it starts one daemon thread per device (stages on the same device
share it), so CUDA devices launch kernels concurrently. Grad mode and the caller's autocast
state are carried into the task ([Note: autocast follows the stage] in executor/precision.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from queue import Queue
from types import TracebackType
from typing import Any, TypeVar

import torch

from executor.local.stream import use_device
from executor.precision import AutocastState

__all__ = ["WorkerPool", "normalize_device"]

T = TypeVar("T")
_Job = tuple[Callable[[], Any], "Future[Any]"]


def normalize_device(device: torch.device | str | int) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, ``cpu:3`` -> ``cpu``; ints are CUDA indices."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cpu":
        return torch.device("cpu")
    return dev


def _run(job: _Job) -> None:
    fn, future = job
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # handed to the caller, which re-raises it
        future.set_exception(exc)


def _loop(queue: Queue[_Job | None], device: torch.device) -> None:
    with use_device(device):
        while (job := queue.get()) is not None:
            _run(job)


class WorkerPool:
    """Runs tasks for pipeline stages, one FIFO worker per distinct device.

    Use as a context manager; :meth:`submit` returns a ``Future``. ``threaded=None`` picks
    threads only when the stages span two or more devices (see [Note: inline worker]).
    """

    def __init__(self, devices: Sequence[torch.device], threaded: bool | None = None) -> None:
        self.devices = [normalize_device(d) for d in devices]
        distinct = list(dict.fromkeys(self.devices))
        self.threaded = len(distinct) > 1 if threaded is None else threaded
        self._worker_of = [distinct.index(d) for d in self.devices]
        self._queues: list[Queue[_Job | None]] = []
        self._threads: list[threading.Thread] = []
        if self.threaded:
            for device in distinct:
                queue: Queue[_Job | None] = Queue()
                thread = threading.Thread(
                    target=_loop, args=(queue, device), daemon=True, name=f"gpipe-{device}"
                )
                self._queues.append(queue)
                self._threads.append(thread)

    @property
    def num_workers(self) -> int:
        return len(self._threads)

    def __enter__(self) -> WorkerPool:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for queue in self._queues:
            queue.put(None)
        for thread in self._threads:
            thread.join()

    def submit(self, stage: int, fn: Callable[[], T]) -> Future[T]:
        """Queue ``fn`` on stage ``stage``'s worker, under the caller's grad mode and autocast."""
        grad_enabled = torch.is_grad_enabled()
        autocast = AutocastState.capture()

        def task() -> T:
            with torch.set_grad_enabled(grad_enabled), autocast.apply():
                return fn()

        future: Future[T] = Future()
        if self.threaded:
            self._queues[self._worker_of[stage]].put((task, future))
        else:
            _run((task, future))
        return future
