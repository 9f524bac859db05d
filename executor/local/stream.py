"""CUDA streams behind one interface that is a no-op on CPU, and stream-aware copies.

Every stage computes on its device's current stream; micro-batches cross devices on separate
copy streams so that transfers overlap compute. On CPU there are no streams: the same code runs
with :data:`CPU_STREAM`, a sentinel every helper here treats as "nothing to do", so the CPU and
CUDA paths of :mod:`executor.local.gpipe` are one path.

:class:`Copy` and :class:`Wait` are autograd functions, so the backward pass moves gradients
back over the same streams in reverse (design from torchgpipe's ``copy.py``; own code).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from executor.microbatch import Batch

__all__ = [
    "CPUStream",
    "CPU_STREAM",
    "AbstractStream",
    "Copy",
    "Wait",
    "copy",
    "wait",
    "new_stream",
    "current_stream",
    "get_device",
    "use_device",
    "use_stream",
    "wait_stream",
    "record_stream",
    "is_cuda",
]


class CPUStream:
    """The stream of a device without streams: work is ordered by the host thread itself."""

    _instance: CPUStream | None = None

    def __new__(cls) -> CPUStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "CPU_STREAM"


CPU_STREAM = CPUStream()
AbstractStream = torch.cuda.Stream | CPUStream


def is_cuda(stream: AbstractStream) -> bool:
    return not isinstance(stream, CPUStream)


def new_stream(device: torch.device) -> AbstractStream:
    """A fresh stream on ``device`` (CUDA), or the CPU sentinel."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def get_device(stream: AbstractStream) -> torch.device:
    if isinstance(stream, CPUStream):
        return torch.device("cpu")
    return stream.device


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device within the context (no-op on CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Make ``stream`` current on its device within the context (no-op on CPU)."""
    if isinstance(stream, CPUStream):
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(waiter: AbstractStream, source: AbstractStream) -> None:
    """Work queued on ``waiter`` from now on starts after all work queued on ``source``."""
    if isinstance(source, CPUStream):
        return  # host work is already done when the host queues more
    if isinstance(waiter, CPUStream):
        source.synchronize()  # the host itself waits
    else:
        waiter.wait_stream(source)


def record_stream(tensor: Tensor, stream: AbstractStream) -> None:
    """Tell the caching allocator that ``tensor`` is used on ``stream`` (no-op on CPU)."""
    if tensor.is_cuda and not isinstance(stream, CPUStream):
        tensor.record_stream(stream)


def _copy_on(
    tensors: tuple[Tensor | None, ...], src: AbstractStream, dst: AbstractStream
) -> list[Tensor | None]:
    """Copy ``tensors`` to ``dst``'s device on the pair of streams (inside the caller's ctx)."""
    device = get_device(dst)
    out: list[Tensor | None] = []
    consumer = current_stream(device)
    with use_stream(src), use_stream(dst):
        for x in tensors:
            if x is None:
                out.append(None)
                continue
            y = x.to(device, non_blocking=device.type == "cuda")
            record_stream(x, src)  # x is read on src, which did not allocate it
            record_stream(y, consumer)  # y is allocated on dst but used on the consumer
            out.append(y)
    return out


class Copy(torch.autograd.Function):
    """Copy tensors from ``prev_stream``'s device to ``next_stream``'s; gradients go back."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)
        out = tuple(t for t in _copy_on(tensors, prev_stream, next_stream) if t is not None)
        ctx.mark_non_differentiable(*[y for y in out if not y.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        back = _copy_on(grads, ctx.next_stream, ctx.prev_stream)
        return (None, None, *back)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream`` before the tensors are used on it."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.set_materialize_grads(False)
        wait_stream(next_stream, prev_stream)
        out = tuple(x.detach() for x in tensors)
        ctx.mark_non_differentiable(*[y for y in out if not y.is_floating_point()])
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None, *grads)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> Batch:
    """``batch`` with every tensor copied to ``next_stream``'s device (differentiably)."""
    tensors = batch.tensors()
    if not tensors:
        return batch
    return batch.with_tensors(Copy.apply(prev_stream, next_stream, *tensors))


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> Batch:
    """``batch`` ordered after ``prev_stream``'s work when used on ``next_stream``."""
    tensors = batch.tensors()
    if not tensors or (not is_cuda(prev_stream) and not is_cuda(next_stream)):
        return batch
    return batch.with_tensors(Wait.apply(prev_stream, next_stream, *tensors))
