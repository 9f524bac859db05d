"""executor.MemoryMeter counts live storage bytes the way an allocator would: against tensors
of sizes the test chooses."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from executor.memory_meter import MemoryMeter

# .ci/compat runs these on every supported torch: the meter leans on a dispatch mode and on torch
# keeping one Python object per live storage
pytestmark = pytest.mark.compat

MIB = 1 << 20


def test_each_storage_is_counted_once_while_it_lives() -> None:
    meter = MemoryMeter()
    with meter:
        a = torch.ones(MIB // 4)  # 1 MiB of fp32
        view = a[: MIB // 8].view(-1, 2)  # a view: no new storage
        assert meter.live == MIB
        b = a * 2  # 1 MiB more
        assert meter.live == 2 * MIB
        del a, view  # the storage goes with its last tensor
        assert meter.live == MIB
        c = torch.empty(3 * MIB, dtype=torch.uint8)
        assert meter.live == 4 * MIB
        del b, c
    assert meter.live == 0
    assert meter.peak == 4 * MIB


def test_tracked_state_counts_and_reset_peak_starts_from_what_lives() -> None:
    model = nn.Linear(256, 256, bias=False)  # 256 KiB of weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 256)).sum().backward()
    opt.step()  # a gradient and a momentum buffer, 256 KiB each
    x = torch.zeros(64, 256)  # 64 KiB
    meter = MemoryMeter(track=(model, opt, [x], {"again": x}))
    assert meter.live == meter.peak == 3 * 256 * 1024 + 64 * 1024
    with meter:
        y = torch.ones(MIB // 4)
        del y
        assert meter.peak == 3 * 256 * 1024 + 64 * 1024 + MIB
        meter.reset_peak()
        assert meter.peak == 3 * 256 * 1024 + 64 * 1024
        torch.ones(16)
    assert meter.peak == 3 * 256 * 1024 + 64 * 1024 + 64


def test_a_backward_and_an_optimizer_step_are_seen() -> None:
    model = nn.Linear(512, 512, bias=False)  # 1 MiB
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.ones(8, 512)
    meter = MemoryMeter(track=(model, opt, x))
    with meter:
        model(x).sum().backward()
        assert meter.live == 2 * MIB + 16 * 1024  # weight, its gradient, x
        opt.step()
    assert meter.live == 4 * MIB + 16 * 1024 + 4  # + exp_avg, exp_avg_sq; a step count of 4 bytes
    assert meter.peak >= meter.live


def test_another_thread_is_not_seen() -> None:
    meter = MemoryMeter()
    with meter:
        thread = threading.Thread(target=lambda: torch.ones(MIB))
        thread.start()
        thread.join()
    assert meter.peak == 0


def test_a_view_of_a_tensor_from_before_the_meter_is_no_new_memory() -> None:
    before = torch.ones(MIB // 4, requires_grad=True)
    meter = MemoryMeter()
    with meter:
        view = before.view(-1, 4)
        view.t()
        before.detach().mul_(2)
        twice = view * 2  # new: 1 MiB
    assert meter.peak == MIB and twice.numel() == MIB // 4
