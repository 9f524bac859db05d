"""One (stage, micro-batch) forward as a task for its device's worker, and the last stage's loss.

    task = StageTask(stage, j, i, device, stream, batch, checkpointed, recorder, loss, precision)
    out, chk = task()   # on the worker: the stage's output, and its Checkpointing if recomputed

GPipe (executor/local/gpipe.py) builds one per (micro-batch, stage) of each clock cycle and
submits it to the stage's worker (executor/local/worker.py). The task runs the stage on its
device and stream under the pipeline's precision ([Note: autocast follows the stage] in
executor/precision.py), checkpointed when the micro-batch is recomputed (executor/recompute.py),
marks its span on a recorded timeline (executor/local/timeline.py), and on the last stage also
computes ``loss_fn(output, target)`` (:class:`MicroBatchLoss`) as part of that stage's work.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from executor.local.stream import AbstractStream, use_device, use_stream
from executor.local.timeline import TimelineRecorder
from executor.microbatch import Batch
from executor.precision import precision_autocast
from executor.recompute import Checkpointing

__all__ = ["StageTask", "MicroBatchLoss"]


class StageTask:
    """Forward of one (stage, micro-batch) on its worker: checkpointed or not, maybe traced."""

    def __init__(
        self,
        stage: nn.Module,
        j: int,
        i: int,
        device: torch.device,
        stream: AbstractStream,
        batch: Batch,
        checkpointed: bool,
        recorder: TimelineRecorder | None,
        loss: MicroBatchLoss | None = None,
        precision: str = "fp32",
    ) -> None:
        self.loss = loss
        self.stage, self.j, self.i, self.device, self.stream = stage, j, i, device, stream
        self.batch, self.checkpointed, self.recorder = batch, checkpointed, recorder
        self.precision = precision

    def _call(self, batch: Batch) -> Batch:
        # the stage's own autocast, inside the caller's; a recomputation replays it (it calls
        # this again) under the forward's autocast state ([Note: autocast follows the stage]);
        # the last stage's loss_fn runs under it too, as part of that stage's work
        with precision_autocast(self.precision, self.device):
            out = batch.call(self.stage)
            return out if self.loss is None else Batch.from_output(self.loss(out.output()))

    def __call__(self) -> tuple[Batch, Checkpointing | None]:
        j, i, device, rec = self.j, self.i, self.device, self.recorder
        batch = self.batch
        with use_device(device), use_stream(self.stream):
            has_end = False
            if rec is not None:
                tensors, has_end = rec.mark_backward_end(j, i, device, batch.tensors())
                batch = batch.with_tensors(tensors)
            with rec.span(j, i, "forward", device) if rec else nullcontext():
                chk: Checkpointing | None = None
                if self.checkpointed:
                    span = (lambda: rec.span(j, i, "recompute", device)) if rec else nullcontext
                    chk = Checkpointing(self._call, batch, device, span)
                    out = chk.checkpoint()
                else:
                    out = self._call(batch)
            if rec is not None:
                out = out.with_tensors(
                    rec.mark_backward_start(j, i, device, out.tensors(), has_end)
                )
        return out, chk


class MicroBatchLoss:
    """``loss_fn(output, target)`` of one micro-batch, run by the last stage's task."""

    def __init__(self, loss_fn: Any, target: Any) -> None:
        self.loss_fn, self.target = loss_fn, target

    def __call__(self, output: Any) -> Any:
        return self.loss_fn(output, self.target)
