"""The live tensor bytes of a whole step and their peak, as a GPU's allocator would report them.

    meter = MemoryMeter(track=(model, optimizer, batch))
    with meter:
        loss = loss_fn(pipe(x), y)
        loss.backward()
        optimizer.step()
    meter.peak          # bytes: the most storage alive at once
    meter.live          # bytes alive now

[Note: counting live bytes] ``torch.cuda.max_memory_allocated`` answers "how much memory did
this step need" on a GPU; a CPU has no such figure (``RssAnon`` counts what glibc keeps, not
what is in use). This meter counts the same thing where it is made: a ``TorchDispatchMode`` sees
every op's outputs, and each output storage not yet known is charged its bytes; a weak
reference to the storage gives them back when the storage is freed (torch keeps one Python
object per live storage, so the reference dies with the storage, not with a wrapper). The
storages that exist before the meter starts (the model's parameters and buffers, their
gradients, the optimizer's state, the batch) are charged from ``track``. A storage is counted
once however many tensors view it, and an op's output that shares an input's storage (a view, an
in-place write) is not new memory. The peak is taken after every op, which is where an
allocator's peak falls too, with what the op made and what it read still alive; what a kernel
allocates and frees inside itself (a CPU kernel's scratch) is not seen. Dispatch modes are
per thread: the meter sees the thread that enters it, which is where a CPU pipeline computes (an
all-CPU executor.GPipe runs its stages inline, [Note: inline worker]; a rank runs its schedule
and autograd on its own thread), and nothing another thread computes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from executor._torch_compat import TorchDispatchMode, tree_leaves

__all__ = ["MemoryMeter"]

_LIFTS = {torch.ops.aten.lift_fresh.default}


class MemoryMeter(TorchDispatchMode):
    """Live and peak bytes of every tensor storage on the meter's thread ([Note: counting live
    bytes])."""

    def __init__(self, track: Iterable[Any] = ()) -> None:
        """``track``: what exists before the meter starts and counts towards its peak: modules
        (their parameters, buffers and gradients), optimizers (their state), tensors, or
        sequences and mappings of these."""
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, weakref.ref[Any]] = {}
        for obj in track:
            self._track(obj)
        self.peak = self.live

    def reset_peak(self) -> None:
        """Start the peak again from what is alive now (one step's peak after another's)."""
        self.peak = self.live

    def _track(self, obj: Any) -> None:
        if isinstance(obj, nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                self._charge(t)
                if t.grad is not None:
                    self._charge(t.grad)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for t in tree_leaves(state):
                    self._charge(t)
        elif isinstance(obj, torch.Tensor):
            self._charge(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                self._track(value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                self._track(value)

    def _charge(self, t: Any) -> None:
        storage = _storage(t)
        if storage is None or t.device.type == "meta":
            return
        key = id(storage)
        if key in self._held and self._held[key]() is storage:
            return
        nbytes = int(storage.nbytes())
        self._held[key] = weakref.ref(storage, functools.partial(self._free, key, nbytes))
        self.live += nbytes

    def _free(self, key: int, nbytes: int, ref: weakref.ref[Any]) -> None:
        if self._held.get(key) is ref:
            del self._held[key]
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result is no new storage, though the input's may predate the
        # meter; but torch.tensor(data) is made outside the dispatcher and only lifted in it
        read = set() if func in _LIFTS else {id(_storage(t)) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if id(_storage(t)) not in read:
                self._charge(t)
        self.peak = max(self.peak, self.live)
        return out


def _storage(t: Any) -> Any:
    """``t``'s untyped storage; None for what is not a tensor or has no storage."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
