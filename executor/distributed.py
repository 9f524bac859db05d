"""This rank's pipeline stages on torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

    pipe = DistributedPipeline([stage], [rank], world, loss_fn=F.cross_entropy, chunks=8,
                               wires=wires, device=torch.device("cpu"))
    loss = pipe.step(x, target=y)      # the mini-batch loss on the last rank, None elsewhere

Every rank calls ``step`` with the same arguments; only the first stage reads the inputs and
only the last reads the target. Gradients accumulate in the stages' parameters exactly as
``mean(loss_fn(stage_chain(x_i), y_i) for each micro-batch i).backward()`` would leave them,
so the caller steps its own optimizer over :attr:`DistributedPipeline.stage_module`.

[Note: what crosses a cut] is in executor/wire.py.

[Note: distributed recomputation] ``checkpoint`` follows executor.checkpoint's modes, one for
every stage or one per stage ([Note: per-stage recomputation] in executor/spec.py): stage ``i``'s
micro-batches ``0 .. checkpoint_stop(modes[i]) - 1`` are recomputed, never in eval mode or
under no_grad (as in executor.GPipe), but it uses
``torch.utils.checkpoint`` (non-reentrant, RNG replayed): a PipelineStage receives a gradient
before it starts a micro-batch's backward, so there is nothing to overlap the recomputation
with and executor.checkpoint's early-recompute lane would buy nothing here.

[Note: a dead rank is an error, not a hang] Gloo may wait for a dead or stuck peer for the
whole process-group timeout (30 minutes by default), or forever (pytorch#132644). The
pipeline therefore talks on its own process group created with ``timeout``, turns any
communication error into :class:`PipelineFailure` naming the rank, step and schedule, and arms
a watchdog per step: if a step overruns ``timeout`` plus a grace period the watchdog prints the
same kind of one-line error and ends the process with exit status 3, as torch's NCCL watchdog
does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. Peers then see the connection drop and fail too.

[Note: tied parameters across ranks] A Parameter used by stages on different ranks (a GPT's
tied embedding and head) exists once per rank. After each step the owners all-reduce (sum) its
gradient on a group of just those ranks, so every copy holds the full gradient and identical
optimizer steps keep the copies equal.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from executor._torch_compat import is_communication_error, prefetch_support, warn_no_prefetch
from executor.checkpoint import checkpoint_stop
from executor.errors import DistributedError
from executor.prefetch import PrefetchGPipe
from executor.spec import SCHEDULES, check_stage_checkpoints
from executor.wire import Wire, WireStage, infer_wires, wire_metas

__all__ = [
    "schedule_class",
    "DistributedError",
    "PipelineFailure",
    "Wire",
    "WireStage",
    "infer_wires",
    "DistributedPipeline",
    "WATCHDOG_EXIT_CODE",
]

_SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": PrefetchGPipe,  # [Note: receive ahead]
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
}
assert tuple(_SCHEDULE_CLASSES) == SCHEDULES, "executor.spec.SCHEDULES lists the runtime's schedules"


def schedule_class(schedule: str) -> type:
    """The torch schedule class that runs ``schedule`` (one of executor.spec.SCHEDULES)."""
    if schedule not in _SCHEDULE_CLASSES:
        raise DistributedError(f"schedule={schedule!r} is unknown; use one of {list(SCHEDULES)}")
    if schedule == "gpipe":
        problem = prefetch_support()
        if problem is not None:
            warn_no_prefetch(problem)
            return ScheduleGPipe
    return _SCHEDULE_CLASSES[schedule]
WATCHDOG_EXIT_CODE = 3
_GRACE_S = 5.0


class PipelineFailure(RuntimeError):
    """A peer rank died, hung or failed mid-step (a runtime fault, not bad input)."""


class _Stage(PipelineStage):
    """PipelineStage that tells its WireStage which micro-batches to recompute."""

    def __init__(self, submodule: WireStage, stop: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        self._stop = stop

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        wire: WireStage = self.submod  # type: ignore[assignment]
        wire.recompute = fwd_chunk_id < self._stop
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            wire.recompute = False


# --- the pipeline -----------------------------------------------------------------------------
class DistributedPipeline:
    """This rank's stages of a pipeline run by a torch.distributed.pipelining schedule.

    Args:
        stages: this rank's stage modules (stage ``i`` takes cut ``i``'s values).
        indices: their global stage indices (rank ``r`` of ``W`` holds ``r, r + W, ...``).
        num_stages: stages in the whole pipeline.
        loss_fn: ``loss_fn(output, target)`` on each micro-batch's output (last stage).
        chunks: micro-batches per mini-batch; the batch size must be a multiple of it.
        checkpoint: ``always``, ``except_last`` or ``never``, or a list with one of them for
            each of the ``num_stages`` stages (see [Note: distributed recomputation]).
        schedule: one of executor.spec.SCHEDULES.
        wires: the wires of every cut, from :func:`infer_wires` (the same on every rank).
        ties: one ``(ranks, parameter or None)`` per parameter held by several ranks, in the
            same order on every rank: the ranks holding a copy, and this rank's copy.
        key_aliases: a state_dict key -> every key of the original model naming that tensor.
        device: where this rank's stages run. timeout: seconds before a silent peer is an error.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        indices: Sequence[int],
        num_stages: int,
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        chunks: int = 8,
        checkpoint: str | Sequence[str] = "except_last",
        schedule: str = "gpipe",
        wires: Sequence[Sequence[Wire]],
        ties: Sequence[tuple[Sequence[int], nn.Parameter | None]] = (),
        key_aliases: dict[str, list[str]] | None = None,
        device: torch.device | str = "cpu",
        timeout: float = 60.0,
    ) -> None:
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized; call "
                                   "torch.distributed.init_process_group(...) on every rank first")
        kind = schedule_class(schedule)
        if chunks < 1:
            raise DistributedError(f"chunks={chunks} < 1: a pipeline needs at least one micro-batch")
        if len(stages) != len(indices) or not stages:
            raise DistributedError(f"got {len(stages)} stages for {len(indices)} indices; pass one index per stage")
        if len(stages) > 1 and schedule != "interleaved1f1b":
            raise DistributedError(f"schedule={schedule!r} runs one stage per rank but this rank has "
                                   f"{len(stages)}; use schedule='interleaved1f1b'")
        if len(wires) != num_stages + 1:
            raise DistributedError(f"got wires for {len(wires)} cuts but {num_stages} stages have "
                                   f"{num_stages + 1}; pass infer_wires(all_stages, micro_batch)")
        try:
            self.checkpoints = check_stage_checkpoints(checkpoint, num_stages)  # every stage's
        except ValueError as err:
            raise DistributedError(str(err)) from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.indices = list(indices)
        self.num_stages, self.chunks, self.schedule_name = num_stages, chunks, schedule
        self.timeout = timeout
        self.device = torch.device(device)
        self.key_aliases = key_aliases or {}
        self._steps = 0
        timedelta = datetime.timedelta(seconds=timeout)
        self.group = dist.new_group(backend=dist.get_backend(), timeout=timedelta)
        self.stages = [s.to(self.device) for s in stages]
        self.wire_stages = [
            WireStage(s, wires[i], wires[i + 1], last=i == num_stages - 1, device=self.device)
            for s, i in zip(self.stages, self.indices, strict=True)
        ]
        self.pipeline_stages = [  # static metadata: no inference run on the first step
            _Stage(w, checkpoint_stop(self.checkpoints[i], chunks), i, num_stages, self.device,
                   input_args=wire_metas(w.inputs), output_args=wire_metas(w.outputs),
                   group=self.group)
            for w, i in zip(self.wire_stages, self.indices, strict=True)
        ]
        self._last = next((w for w, i in zip(self.wire_stages, indices, strict=True) if i == num_stages - 1), None)
        self._loss_fn = loss_fn
        if schedule == "interleaved1f1b":
            self._schedule = kind(self.pipeline_stages, chunks, loss_fn=self._loss, scale_grads=False)
        else:
            self._schedule = kind(self.pipeline_stages[0], chunks, loss_fn=self._loss, scale_grads=False)
        self._ties = [(dist.new_group(ranks=sorted(r), timeout=timedelta), p) for r, p in ties]

    @property
    def is_first(self) -> bool:
        return 0 in self.indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    @property
    def stage_module(self) -> nn.Module:
        """This rank's stage (an ``nn.ModuleList`` of them when it holds several)."""
        return self.stages[0] if len(self.stages) == 1 else nn.ModuleList(self.stages)

    PART_METADATA = "autopipe:part"  # see [Note: checkpoint parts]

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the original model's keys (tied: every key).

        [Note: checkpoint parts] The keys are exactly what ``model.state_dict()`` has for the
        tensors this rank holds. Which part of which pipeline this is (rank, world, stage
        indices, number of stages, steps taken) rides outside the keys, in the dict's
        ``_metadata`` under ``PART_METADATA``, where torch keeps its own per-module versions
        (``torch.save`` keeps it, ``load_state_dict`` ignores it), so that merging the parts
        (autopipe.merge_state_dicts) can name a missing rank or a part of another pipeline.
        """
        out: OrderedDict[str, Any] = OrderedDict()
        for stage in self.stages:
            for key, value in stage.state_dict().items():
                for alias in self.key_aliases.get(key, [key]):
                    out[alias] = value
        out._metadata = OrderedDict({self.PART_METADATA: {  # type: ignore[attr-defined]
            "rank": self.rank, "world": self.world, "stages": list(self.indices),
            "num_stages": self.num_stages, "steps": self._steps}})
        return out

    def _loss(self, output: Any, target: Any) -> Tensor:
        assert self._last is not None
        return self._loss_fn(self._last.unflatten(output), target)

    def step(self, *inputs: Any, target: Any = None) -> Tensor | None:
        """Run one mini-batch forward and backward; the mean micro-batch loss on the last rank."""
        if self.is_first:
            self._check_batch(inputs, "inputs")
        if self.is_last:
            if target is None:
                raise DistributedError("the last rank needs target=...: step(*inputs, target=y) on every rank")
            self._check_batch((target,), "target")
        self._steps += 1
        losses: list[Tensor] = []
        with self._watchdog():
            try:
                self._schedule.step(*(inputs if self.is_first else ()),
                                    target=target if self.is_last else None,
                                    losses=losses if self.is_last else None, return_outputs=False)
                self._finish_grads()
            except RuntimeError as err:
                if not is_communication_error(err):
                    raise  # this rank's own bug (a shape error, out of memory): not a peer's fault
                raise PipelineFailure(self._failure(str(err).strip().splitlines()[0])) from err
        return torch.stack([x.detach() for x in losses]).mean() if self.is_last else None

    def _check_batch(self, values: Sequence[Any], what: str) -> None:
        for v in values:
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] % self.chunks:
                raise DistributedError(
                    f"{what} batch size {v.shape[0]} is not a multiple of chunks={self.chunks}: "
                    "PipelineStage needs equal micro-batches; use a batch divisible by chunks"
                )

    def _finish_grads(self) -> None:
        """Mean over micro-batches (each parameter once), then sum tied copies across ranks."""
        seen: set[int] = set()
        for stage in self.stages:
            for p in stage.parameters():
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    p.grad.div_(self.chunks)
        for group, tied in self._ties:
            if tied is None:
                continue
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=group)

    def _failure(self, cause: str) -> str:
        return (f"rank {self.rank}/{self.world}: pipeline step {self._steps} ({self.schedule_name}, "
                f"stages {self.indices}) failed: a peer rank died, hung or failed ({cause}); "
                "see that rank's log")

    @contextmanager
    def _watchdog(self) -> Iterator[None]:
        def fire() -> None:
            msg = self._failure(f"no progress for {self.timeout + _GRACE_S:.0f}s")
            print(f"PipelineFailure: {msg}", file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT_CODE)

        timer = threading.Timer(self.timeout + _GRACE_S, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
