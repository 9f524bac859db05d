"""Device timers and memory meters: the only place that knows how a device measures itself.

    timer = timer_for(torch.device("cpu"))
    out, ms = timer(lambda: layer(x))          # one timed call, in milliseconds

[Note: one timing path per device] The profiler times every layer through a :class:`Timer`
and reads memory through a :class:`MemoryMeter`, and never asks which device it runs on. On CPU
a call is synchronous, so ``time.perf_counter`` around it is exact. On CUDA a call only
*launches* kernels: :class:`CudaTimer` records CUDA events around the launch and synchronises
on the end event, so the time is the kernels' time on the device, not the Python launch time.
Peak memory exists only where the device reports it (CUDA's caching allocator); on CPU the meter
returns None and the profile's ``peak_bytes`` is NaN.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = [
    "Timer",
    "CpuTimer",
    "CudaTimer",
    "MemoryMeter",
    "CudaMemoryMeter",
    "timer_for",
    "memory_meter_for",
    "median",
]

T = TypeVar("T")


class Timer:
    """Times one call of a zero-argument function; returns its result and milliseconds.

    ``harness_cost``: whether calling a layer through the harness costs time this timer sees
    (a clock does: [Note: harness overhead], [Note: split backward measured]); a timer that
    counts the layer's own kernels does not ([Note: counted, not timed]), and nothing is
    subtracted from its times."""

    harness_cost = True

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all work queued on the device so far has finished."""


class CpuTimer(Timer):
    """Wall time via ``time.perf_counter``: CPU ops run synchronously.

    ``clock=time.process_time`` counts this process's CPU time instead, which time slices
    given to other processes do not inflate (benchmarks on a shared machine use it).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        start = self.clock()
        out = fn()
        return out, (self.clock() - start) * 1e3


class CudaTimer(Timer):
    """Device time between two CUDA events recorded on the current stream around the call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        with torch.cuda.device(self.device):
            self._start.record()
            out = fn()
            self._end.record()
            self._end.synchronize()
            return out, float(self._start.elapsed_time(self._end))


class MemoryMeter:
    """Peak bytes allocated above the starting level while a region runs (None: not reported)."""

    def start(self) -> None:
        """Begin a region: forget earlier peaks."""

    def peak(self) -> int | None:
        """Peak allocated bytes since :meth:`start`, above the level at :meth:`start`."""
        return None


class CudaMemoryMeter(MemoryMeter):
    """``torch.cuda.max_memory_allocated`` relative to the allocation at the region's start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        torch.cuda.synchronize(self.device)
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - self._base)


def timer_for(device: torch.device) -> Timer:
    """The timer that measures ``device`` correctly (see [Note: one timing path per device])."""
    return CudaTimer(device) if device.type == "cuda" else CpuTimer()


def memory_meter_for(device: torch.device) -> MemoryMeter:
    """A meter reporting peak memory on CUDA, and nothing (None) elsewhere."""
    return CudaMemoryMeter(device) if device.type == "cuda" else MemoryMeter()


def median(samples: Sequence[float]) -> float:
    """Median of the samples; 0.0 for none (a phase that does no work)."""
    return float(statistics.median(samples)) if samples else 0.0
