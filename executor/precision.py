"""Mixed precision: autocast inside every stage, and the caller's autocast where a stage runs.

[Note: mixed precision] A pipeline's ``precision`` (executor.spec.PRECISIONS) is how its
stages compute: ``"fp32"``, or ``torch.autocast`` to ``"bf16"`` / ``"fp16"`` around every
stage call, while the parameters stay fp32 (the master copy the optimizer steps), and so do
their gradients and any reduction of them. This is torch's own recipe (``torch.autocast``
plus, for fp16, a gradient scaler), applied per stage because a stage may run on another
thread, on another rank, or again in backward when it is recomputed.

[Note: autocast follows the stage] Autocast is thread-local state, and so is what the caller
set with ``with torch.autocast(...)`` around a pipeline call. A stage therefore runs under an
:class:`AutocastState` captured where the call was made: a worker thread enters it before the
stage (executor.local.worker), a recomputation enters the state its forward ran under
(executor.recompute), so recomputed activations have the dtypes the forward had. A pipeline's
own ``precision`` enters inside that state, and only where it asks for autocast: with
``precision="fp32"`` the caller's autocast is what holds.

[Note: distributed mixed precision] ``precision="bf16"`` (or ``"fp16"``) runs every call of a
rank's stages (executor/ranks/distributed.py), their recomputation and the loss under
``torch.autocast`` to that dtype on ``device``, over fp32 parameters ([Note: mixed precision]);
the wires are those of a probe under the same autocast, so activations cross in the low dtype
([Note: wires under autocast] in executor/ranks/wire.py). A caller's own ``with torch.autocast(...):
pipe.step(...)`` holds too (the schedule runs the stages in the calling thread, and a
recomputation replays its forward's state). Gradients, their mean over micro-batches, the sum
of tied copies and the replicas' reduction stay fp32 (executor/ranks/replicated.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from executor.spec import check_precision

__all__ = ["AutocastState", "precision_autocast", "compute_dtype"]

_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DEVICE_TYPES = ("cpu", "cuda")


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype stages compute in under ``precision`` (fp32 for ``"fp32"``)."""
    return _DTYPES[check_precision(precision)] or torch.float32


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of one thread: per device type (enabled, dtype), and the cast
    cache flag. ``capture()`` reads the calling thread's; ``apply()`` re-enters them anywhere."""

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool

    @classmethod
    def capture(cls) -> AutocastState:
        devices = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                        for d in _DEVICE_TYPES)
        return cls(devices, torch.is_autocast_cache_enabled())

    @property
    def enabled(self) -> bool:
        return any(on for _, on, _ in self.devices)

    @contextmanager
    def apply(self) -> Iterator[None]:
        """Run under exactly these settings: each device type whose state differs from the
        calling thread's is entered (or turned off, where these have it off); where they are
        already the thread's, nothing is entered."""
        now = AutocastState.capture()
        if now == self:
            yield
            return
        here = {d: (on, dtype) for d, on, dtype in now.devices}
        with ExitStack() as stack:
            for device_type, on, dtype in self.devices:
                if here[device_type] != (on, dtype) or (on and now.cache != self.cache):
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=on,
                                                       cache_enabled=self.cache))
            yield


@contextmanager
def precision_autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast for a stage on ``device`` under ``precision``; nothing for ``"fp32"``."""
    dtype = _DTYPES[check_precision(precision)]
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield
