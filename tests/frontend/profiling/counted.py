"""Layers whose cost the test declares, and a clock that only they move.

The profiler's corrections are ratios of measured times (in sequence over alone, checkpointed
over plain, one half of a backward over the whole, ...). Timed on a real clock they are only
known to lie somewhere in the range the code clamps them into. Timed on :data:`CLOCK`, through
``CpuTimer(clock=CLOCK)`` (and ``LayerStamps(clock=CLOCK)``), a :class:`Counted` layer takes
exactly the milliseconds it declares and everything else (the harness, an empty stage, torch's
own bookkeeping) takes none, so every correction has a truth the test computes from the
declared costs, whatever else the machine is doing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


class CountedClock:
    """Seconds of declared work: moved only by :meth:`charge` (``__call__`` reads it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.last_forward = ""  # the name of the Counted layer whose forward ran last

    def __call__(self) -> float:
        return self.now

    def charge(self, ms: float) -> None:
        self.now += ms / 1e3


CLOCK = CountedClock()  # one clock for every layer: a deep copy of a model still moves it


class _ChargeOnBackward(torch.autograd.Function):
    """Identity forward; its backward charges ``ms`` to :data:`CLOCK`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, ms: float) -> Tensor:
        ctx.ms = ms
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        CLOCK.charge(ctx.ms)
        return grad, None


@dataclass(frozen=True)
class Cost:
    """What one :class:`Counted` layer declares, in ms: its forward with and without autograd,
    the extra a forward pays when another layer's forward ran just before it (a cold cache,
    which a layer timed alone over and over never pays), and the two halves of its backward
    (the input's gradient, the weight's)."""

    fwd: float
    fwd_no_grad: float
    cold: float
    bwd_input: float
    bwd_weight: float


class Counted(nn.Module):
    """``x * weight`` (a leaf module: one layer) that costs what its :class:`Cost` says."""

    def __init__(self, name: str, cost: Cost, dim: int = 4) -> None:
        super().__init__()
        self.name, self.cost = name, cost
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        CLOCK.charge(self.cost.fwd if torch.is_grad_enabled() else self.cost.fwd_no_grad)
        if CLOCK.last_forward != self.name:
            CLOCK.charge(self.cost.cold)
        CLOCK.last_forward = self.name
        x = _ChargeOnBackward.apply(x, self.cost.bwd_input)
        return x * _ChargeOnBackward.apply(self.weight, self.cost.bwd_weight)


class CountedChain(nn.Module):
    """:class:`Counted` layers in a row, named ``a``, ``b``, ...: traced, one layer each."""

    def __init__(self, *costs: Cost, dim: int = 4) -> None:
        super().__init__()
        self.names = [chr(ord("a") + i) for i in range(len(costs))]
        for name, cost in zip(self.names, costs, strict=True):
            self.add_module(name, Counted(name, cost, dim))

    def forward(self, x: Tensor) -> Tensor:
        for name in self.names:
            x = getattr(self, name)(x)
        return x
