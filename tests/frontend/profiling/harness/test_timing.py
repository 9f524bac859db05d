from __future__ import annotations

import time

import torch

from autopipe.frontend.profiling.harness.timing import (
    CpuTimer,
    CudaTimer,
    MemoryMeter,
    median,
    memory_meter_for,
    timer_for,
)
from tests.conftest import skip_if_no_cuda


def test_cpu_timer_returns_result_and_milliseconds() -> None:
    timer = timer_for(torch.device("cpu"))
    assert isinstance(timer, CpuTimer)
    out, short = timer(lambda: 7)
    _, long = timer(lambda: time.sleep(0.2))
    # a wall clock: at least the sleep (a load only lengthens it); the call that returns at once
    # shorter than 200 ms, a stall between two clock reads that no load on 2 cores comes near
    assert out == 7 and 0 <= short < long and long >= 199.0


def test_process_clock_ignores_sleep() -> None:
    # the same sleep on both clocks: the wall clock's at least 50 ms, the process's no more than
    # half of it (sleeping uses no CPU time; another process's load adds to neither)
    _, ms = CpuTimer(time.process_time)(lambda: time.sleep(0.05))
    _, wall = CpuTimer()(lambda: time.sleep(0.05))
    assert wall >= 49.0 and ms < 25.0


def test_median_and_cpu_memory_meter() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([]) == 0.0
    meter = memory_meter_for(torch.device("cpu"))
    assert type(meter) is MemoryMeter
    meter.start()
    assert meter.peak() is None


@skip_if_no_cuda
def test_cuda_timer_and_meter() -> None:
    # the truth is a delay the test injects: torch.cuda._sleep spins the GPU for a number of
    # cycles and returns at once on the CPU, so only device time sees it. One warm call first:
    # a process's first kernel pays for loading it (120 ms on an H200 once, which made a
    # 64 x 64 matmul "slower" than twenty 1024 x 1024 ones). Ten times the cycles: about ten
    # times the time, whatever the clock; 10^7 cycles are over 3 ms below 3 GHz
    dev = torch.device("cuda", 0)
    timer = timer_for(dev)
    assert isinstance(timer, CudaTimer)
    timer(lambda: torch.cuda._sleep(1000))
    _, small = timer(lambda: torch.cuda._sleep(10**6))
    _, big = timer(lambda: torch.cuda._sleep(10**7))
    assert 0 < small and 5 * small < big and big > 1.0
    meter = memory_meter_for(dev)
    meter.start()
    b = torch.empty(1 << 20, device=dev)
    peak = meter.peak()
    del b
    assert peak is not None and peak >= 4 << 20
