"""GPipe on torch.distributed.pipelining, with every receive posted ahead of time.

[Note: receive ahead] torch's ``ScheduleGPipe`` posts the receive for micro-batch i only when it
reaches micro-batch i, so a rank that finishes a forward then sits idle while the next
activation crosses the wire, and on CPU (gloo) that transfer competes with the compute it should
have overlapped. Each micro-batch has its own receive buffer in a PipelineStage, so nothing stops
us posting all of a phase's receives up front: the data lands while the rank computes, and the
wait before each micro-batch is usually already over (measured: docs/benchmarks.md, "Two
processes vs one"). The schedule, the loss handling and the gradient scaling are otherwise
exactly ``ScheduleGPipe``'s.

[Note: yield after sends] Over gloo a send posted before the peer's receive notice was handled
moves its bytes from gloo's I/O thread, and on a rank pinned to one core ([Note: ranks pinned
to cores] in executor/ranks/rank_cores.py) that thread waits for the core while the rank computes
its next micro-batch, so the peer waits for those bytes through that whole computation. So
after posting its sends a CPU rank yields its core once (``os.sched_yield``, a microsecond when
nothing else is runnable), and the I/O thread moves the bytes first. torch's 1F1B waits for its
sends itself. Measured: docs/benchmarks.md, "Measured vs predicted, two ranks"; the trace and
A/B runs behind this Note are in CHANGELOG.md, "GPipe ranks yield their core after posting
sends".

The override and the helpers it calls are private to torch.distributed.pipelining: they come
from executor._torch_compat, which checks their signatures ([Note: private torch API]); where
they differ, executor.ranks.distributed runs the public ScheduleGPipe instead.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.pipelining import ScheduleGPipe

from executor._torch_compat import (
    initialize_stage,
    maybe_compute_loss,
    release_fwd_send,
    sorted_batch_p2p,
    wait_batch_p2p,
)

__all__ = ["PrefetchGPipe", "after_sends"]


def after_sends(device: torch.device) -> None:
    """Let gloo's I/O thread move what was just posted before this rank computes on
    ([Note: yield after sends]); nothing on a GPU (NCCL moves it on the device)."""
    if device.type == "cpu" and hasattr(os, "sched_yield"):
        os.sched_yield()


class PrefetchGPipe(ScheduleGPipe):
    """``ScheduleGPipe`` that posts all forward receives at the start of the forward phase and
    all gradient receives at the start of the backward phase ([Note: receive ahead])."""

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        initialize_stage(self, arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage, n = self._stage, self._n_microbatches

        recvs = [sorted_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv") for i in range(n)]
        fwd_sends: list[list[Any]] = []
        for i in range(n):
            for work in recvs[i].values():
                wait_batch_p2p(work)
            output = stage.forward_one_chunk(
                i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs
            )
            works = sorted_batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send")
            fwd_sends.append(list(works.values()))
            after_sends(stage.device)
            maybe_compute_loss(self, stage, output, target_mbs, i, loss_kwargs)
        for i, posted in enumerate(fwd_sends):
            for work in posted:
                wait_batch_p2p(work)
            release_fwd_send(stage, i)

        recvs = [sorted_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv") for i in range(n)]
        sends: list[Any] = []
        for i in range(n):
            for work in recvs[i].values():
                wait_batch_p2p(work)
            loss = self._maybe_get_loss(stage, i)
            stage.backward_one_chunk(i, loss=loss, last_backward=i == n - 1)
            sends.extend(sorted_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send").values())
            after_sends(stage.device)
        for work in sends:
            wait_batch_p2p(work)

        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)
