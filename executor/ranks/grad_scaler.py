"""fp16 loss scaling for a pipeline on ranks: torch's GradScaler, its found-inf shared by every rank.

    scaler = PipelineGradScaler(pipe)              # on every rank
    loss = pipe.step(x, target=y, scaler=scaler)   # each micro-batch's loss scaled in the schedule
    scaler.unscale_(opt)                           # found-inf reduced over every rank
    pipe.clip_grad_norm_(1.0)
    scaler.step(opt)                               # skipped on EVERY rank if any gradient overflowed
    scaler.update()                                # the same new scale on every rank

[Note: loss scaling on ranks] In one process ``torch.amp.GradScaler`` works on executor.GPipe
as on any model (``scaler.scale(loss).backward()``; its per-device found-inf flags cover
stages on several devices). On ranks two things differ, and this class handles both:

- the loss exists only inside the schedule's loss function on the last stage, so
  ``DistributedPipeline.step(..., scaler=)`` scales it there, per micro-batch, and returns
  the unscaled mean; every rank holds the scale from the start (the others never see a loss),
  so each can unscale its own gradients;
- each rank sees only its own gradients, so after ``unscale_`` the found-inf flag is reduced
  with MAX over the pipeline's group and then its replicas' ("dp") group
  (``pipe.found_inf_groups()``): an overflow on any stage of any replica skips ``step`` on
  every rank and backs the scale off everywhere, and a clean step grows it after
  ``growth_interval`` clean steps, exactly as torch's does (torch's own ``update`` moves it).

``step`` without an earlier ``unscale_`` unscales first, so the flags are always shared.
Gradients tied across ranks are summed in ``pipe.step`` before any of this, so each copy holds
the same flags.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from executor._torch_compat import found_inf_per_device

if TYPE_CHECKING:
    from executor.ranks.distributed import DistributedPipeline

__all__ = ["PipelineGradScaler"]


class PipelineGradScaler(GradScaler):
    """``torch.amp.GradScaler`` for one rank of ``pipe``; build one on every rank.

    Args as torch's (``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``enabled``); the device is the pipeline's. See
    [Note: loss scaling on ranks].
    """

    def __init__(self, pipe: DistributedPipeline, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__(pipe.device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.groups = pipe.found_inf_groups()
        self.device = pipe.device
        self._shared: set[int] = set()  # optimizers whose flags were reduced since update()
        if enabled:
            self.scale(torch.zeros((), device=pipe.device))  # the scale now lives on every rank

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_``, then this optimizer's found-inf made the same on every rank."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        flags = found_inf_per_device(self, optimizer)
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        for flag in flags.values():
            found = torch.maximum(found, flag.reshape(()).to(self.device, torch.float32))
        for group in self.groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        for flag in flags.values():
            flag.copy_(found.reshape(flag.shape))
        if not flags:  # no gradient on this rank: torch's step and update need one flag
            flags[self.device] = found
        self._shared.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """``optimizer.step()`` unless a gradient on any rank overflowed (unscaling first if
        ``unscale_`` was not called)."""
        if self.is_enabled() and id(optimizer) not in self._shared:
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update``: every rank's flags are equal, so the scale moves alike on all."""
        super().update(new_scale)
        self._shared.clear()
