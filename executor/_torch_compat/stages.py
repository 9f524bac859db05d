"""A PipelineStage that runs on torch 2.11 and 2.12 as it runs on 2.13: gradients of floating-point
values only, and the last stage's outputs in the dtype autocast gives them.

[Note: integers across a cut] A cut may carry integers: an HF batch's attention mask or
positions, a GPT's sequence length. torch 2.13 gives a receive buffer a gradient only where its
value is floating point, and sends and receives gradients of those only. torch 2.11 (the GPU
machine's) asks every receive buffer for one (``requires_grad_(True)``: "only Tensors of
floating point dtype can require gradients"), expects a gradient back for every received
value and waits for one for every sent value. :class:`CompatStage`, mixed into
executor/ranks/sized.py's stage, does what 2.13 does where torch's own stage does not
(``ASKS_EVERY_BUFFER``, read from the source of torch's ``_prepare_forward_infra``, which then
sets ``requires_grad_(True)`` without asking ``is_floating_point``; 2.13 and 2.15 set it
elsewhere, by the value's dtype): the buffers of floating values get a gradient (also when the
first run had no backward, an ``eval_step`` before any ``step``: 2.11 makes them at that run,
without one, and sets none later), a received
integer sends none back, a sent integer waits for none, and the gradients the stage back-propagates
from line up with its outputs again (None for an integer's); a floating value the stage did not
use sends zeros back, as 2.13 does, where 2.11 refuses to send none. Each override calls torch's method;
on torch 2.13 or newer none of them changes anything.

[Note: the last stage's dtype] Under ``precision=`` the last stage's outputs (the model's
output, which no rank receives) are in autocast's dtype, not the dtype the stage was traced in.
torch 2.11 checks every stage's outputs against the traced metadata and refuses ("value 0 has a
dtype mismatch"); 2.13 checks only under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. The last stage is
not checked here; the others send through executor/ranks/wire.py's fixed messages.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

__all__ = ["ASKS_EVERY_BUFFER", "CompatStage"]


def _asks_every_buffer() -> bool:
    try:
        source = inspect.getsource(PipelineStage._prepare_forward_infra)
    except (AttributeError, OSError, TypeError):
        return False
    return "requires_grad_(True)" in source and "is_floating_point" not in source


ASKS_EVERY_BUFFER = _asks_every_buffer()


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class CompatStage(PipelineStage):
    """[Note: integers across a cut], [Note: the last stage's dtype]."""

    def _validate_fwd_outputs(self, outputs: tuple[Any, ...]) -> None:
        if not self.is_last:
            super()._validate_fwd_outputs(outputs)  # type: ignore[misc]

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        if not ASKS_EVERY_BUFFER:  # its arguments differ between releases: passed on as given
            return super()._prepare_forward_infra(*args, **kwargs)
        backward, self.has_backward = self.has_backward, False  # it would ask every buffer
        try:
            out = super()._prepare_forward_infra(*args, **kwargs)
        finally:
            self.has_backward = backward
        if backward:
            for infos in self.args_recv_info.values():
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
                        buffer.requires_grad_(True)
        return out

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # torch 2.11 gives the receive buffers their gradient when it makes them, at the first
        # forward: a first run without backward (eval_step before any step) made them without,
        # and the stage's inputs then had no gradient to send back in every later step
        out = super()._prepare_backward_infra(*args, **kwargs)  # type: ignore[misc]
        if ASKS_EVERY_BUFFER:
            for infos in self.args_recv_info.values():
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor) and buffer.is_floating_point() and not buffer.requires_grad:
                        buffer.requires_grad_(True)
        return out

    def set_local_fwd_input(self, prev_stage_outputs: Any, mb_index: int) -> None:
        if not ASKS_EVERY_BUFFER:
            super().set_local_fwd_input(prev_stage_outputs, mb_index)
            return
        # a stage on the same rank (the V schedules): torch 2.11 sets requires_grad on each value
        outputs = tuple(prev_stage_outputs) if isinstance(prev_stage_outputs, (tuple, list)) else (prev_stage_outputs,)
        for info, tensor in zip(self.args_recv_info[mb_index], outputs, strict=True):
            info.buffer = tensor.detach().requires_grad_(True) if _is_float(tensor) else tensor.detach()

    def _create_grad_send_info(self, args_recv_info: tuple[Any, ...]) -> list[int | None]:
        sources = super()._create_grad_send_info(args_recv_info)
        if not ASKS_EVERY_BUFFER:
            return sources  # type: ignore[no-any-return]
        return [s if s is None or _is_float(getattr(info, "buffer", None)) else None
                for s, info in zip(sources, args_recv_info, strict=True)]

    def _float_outputs(self) -> list[bool]:
        return [_is_float(meta) for meta in getattr(self, "get_outputs_meta")()]  # noqa: B009 (2.11's)

    def _create_grad_recv_info(self, act_send_info: dict[int, Any]) -> tuple[Any, ...]:
        if not ASKS_EVERY_BUFFER:
            return super()._create_grad_recv_info(act_send_info)  # type: ignore[no-any-return]
        floats = self._float_outputs()
        return super()._create_grad_recv_info(  # type: ignore[no-any-return]
            {i: dst for i, dst in act_send_info.items() if floats[i]})

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        if not ASKS_EVERY_BUFFER or self.is_last:
            return grads
        received = iter(grads)
        return tuple(next(received) if f else None for f in self._float_outputs())

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if ASKS_EVERY_BUFFER:  # the next stage's gradients of this stage's floating outputs only
            floats = [g for g, f in zip(next_stage_bwd_outputs, self._float_outputs(), strict=True) if f]
            next_stage_bwd_outputs = tuple(
                torch.zeros_like(info.buffer) if g is None else g
                for g, info in zip(floats, self.grad_recv_info[mb_index], strict=True))
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
        # a floating value the stage did not use has no gradient; torch 2.11 refuses to send
        # none where the sender waits for one, so it gets zeros, as torch 2.13 sends
        if ASKS_EVERY_BUFFER and self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
            if self.grad_send_info is None:
                self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
            grads = self.bwd_cache[bwd_chunk_id]
            self.bwd_cache[bwd_chunk_id] = tuple(
                torch.zeros_like(getattr(info, "buffer")) if g is None and dst is not None else g  # noqa: B009
                for g, dst, info in zip(grads, self.grad_send_info, self.args_recv_info[bwd_chunk_id], strict=True))
        return super().get_bwd_send_ops(bwd_chunk_id)  # type: ignore[no-any-return]
