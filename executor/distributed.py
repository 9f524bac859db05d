"""This rank's pipeline stages on torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B).

    pipe = DistributedPipeline([stage], [rank], world, loss_fn=F.cross_entropy, chunks=8,
                               wires=wires, device=torch.device("cpu"))
    loss = pipe.step(x, target=y)      # the mini-batch loss on the last rank, None elsewhere

Every rank calls ``step`` with the same arguments; only the first stage reads the inputs and
only the last reads the target. Gradients accumulate in the stages' parameters exactly as
``mean(loss_fn(stage_chain(x_i), y_i) for each micro-batch i).backward()`` would leave them,
so the caller steps its own optimizer over :attr:`DistributedPipeline.stage_module`.

[Note: what crosses a cut] Our stages take and return the tuple of values live at a cut
(DESIGN.md "Stages are a linear chain"), and those may be Python values: ``n = x.size(1)``
used after the cut is an ``int``, an optional argument may be ``None``. PipelineStage sends
tensors only, so each stage runs inside a :class:`WireStage` that encodes its outputs and
decodes its inputs following a :class:`Wire` per value, fixed at build time by
:func:`infer_wires` (one probe run of the whole chain on the example micro-batch): a tensor is
sent as is; an ``int``/``float``/``bool`` as a 0-d int64/float64 tensor and a ``torch.Size``
(or tuple/list of ints) as a 1-d int64 tensor, decoded back to the same Python type, so values
that depend on the micro-batch stay exact; anything else (``None``, a dtype, a string) is a
constant baked into both sides and never sent, and the sender checks that it did not change.
The last stage's output (any pytree, e.g. a HuggingFace ModelOutput) is flattened to its
tensor leaves for the schedule and rebuilt before ``loss_fn`` sees it.

[Note: distributed recomputation] ``checkpoint`` follows executor.checkpoint's modes
(micro-batches ``0 .. checkpoint_stop - 1`` are recomputed) but uses
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
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
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from executor.checkpoint import checkpoint_stop
from executor.errors import ExecutorError
from executor.prefetch import PREFETCH_AVAILABLE, PrefetchGPipe

__all__ = [
    "SCHEDULES",
    "DistributedError",
    "PipelineFailure",
    "Wire",
    "WireStage",
    "infer_wires",
    "DistributedPipeline",
    "WATCHDOG_EXIT_CODE",
]

SCHEDULES: dict[str, type] = {
    "gpipe": PrefetchGPipe if PREFETCH_AVAILABLE else ScheduleGPipe,  # [Note: receive ahead]
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
}
WATCHDOG_EXIT_CODE = 3
_GRACE_S = 5.0


class DistributedError(ExecutorError):
    """A distributed pipeline that cannot be built or run as configured."""


class PipelineFailure(RuntimeError):
    """A peer rank died, hung or failed mid-step (a runtime fault, not bad input)."""


# --- wires: how a live value crosses a cut ----------------------------------------------------
@dataclass(frozen=True)
class Wire:
    """How one value live at a cut crosses ranks: ``tensor``, ``scalar``, ``ints`` or ``const``.

    ``shape``/``stride``/``dtype``/``requires_grad`` describe the tensor on the wire (at the
    example micro-batch): PipelineStage gets them up front and skips its metadata inference.
    """

    kind: str
    pytype: type | None = None  # int / float / bool for scalars; tuple / list / Size for ints
    value: Any = None  # the constant, for kind == "const"
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    requires_grad: bool = False

    @staticmethod
    def of(value: Any) -> Wire:
        if isinstance(value, Tensor):
            return Wire("tensor", None, None, tuple(value.shape), tuple(value.stride()), value.dtype,
                        value.requires_grad)
        if isinstance(value, (bool, int, float)):
            return Wire("scalar", type(value), dtype=torch.float64 if isinstance(value, float) else torch.int64)
        if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return Wire("ints", type(value), shape=(len(value),), stride=(1,))
        return Wire("const", None, value)

    def meta(self) -> Tensor | None:
        """An example of the tensor on the wire (meta device), or None for a constant."""
        if self.kind == "const":
            return None
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad)


def _metas(wires: Sequence[Wire]) -> tuple[Tensor, ...]:
    return tuple(t for t in (w.meta() for w in wires) if t is not None)


def _encode(values: Sequence[Any], wires: Sequence[Wire], device: torch.device) -> tuple[Tensor, ...]:
    if len(values) != len(wires):
        raise DistributedError(f"a stage returned {len(values)} values but its cut carries {len(wires)}; "
                               "rebuild the pipeline from the same model and plan on every rank")
    out: list[Tensor] = []
    for k, (value, wire) in enumerate(zip(values, wires, strict=True)):
        if wire.kind == "tensor":
            out.append(value)
        elif wire.kind == "scalar":
            out.append(torch.tensor(value, dtype=wire.dtype, device=device))
        elif wire.kind == "ints":
            out.append(torch.tensor(list(value), dtype=torch.int64, device=device))
        elif not _same(value, wire.value):
            raise DistributedError(
                f"cut value {k} was the constant {wire.value!r} when the pipeline was built but is "
                f"{value!r} now; such values are not sent, so keep it fixed or make it a tensor"
            )
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 - values without a usable == are compared by identity only
        return False


def _decode(tensors: Sequence[Tensor], wires: Sequence[Wire]) -> tuple[Any, ...]:
    it: Iterator[Tensor] = iter(tensors)
    out: list[Any] = []
    for wire in wires:
        if wire.kind == "tensor":
            out.append(next(it))
        elif wire.kind == "scalar":
            assert wire.pytype is not None
            out.append(wire.pytype(next(it).item()))
        elif wire.kind == "ints":
            assert wire.pytype is not None
            out.append(wire.pytype(int(v) for v in next(it).tolist()))
        else:
            out.append(wire.value)
    return tuple(out)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


@contextmanager
def _probing(stages: Sequence[nn.Module]) -> Iterator[None]:
    """Eval mode (no BatchNorm statistic updates) and a forked RNG, restored afterwards."""
    modes = [(m, m.training) for s in stages for m in s.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for s in stages:
                s.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


def infer_wires(stages: Sequence[nn.Module], example_inputs: tuple[Any, ...]) -> list[tuple[Wire, ...]]:
    """The wires of every cut from one probe run of the chain (with autograd, so that
    ``requires_grad`` is known): cut 0 is the model's inputs, cut ``i`` stage ``i``'s inputs,
    and the extra last cut the tensor leaves of the model's output (what the loss receives)."""
    bad = [k for k, v in enumerate(example_inputs) if not isinstance(v, Tensor)]
    if bad:
        raise DistributedError(
            f"model inputs {bad} are not tensors; torch.distributed.pipelining feeds the first "
            "stage tensors only: pass non-tensor arguments as constants of the model instead"
        )
    wires: list[tuple[Wire, ...]] = []
    values: tuple[Any, ...] = tuple(example_inputs)
    with _probing(stages):
        for i, stage in enumerate(stages):
            wires.append(tuple(Wire.of(v) for v in values))
            out = stage(*values)
            values = _as_tuple(out) if i < len(stages) - 1 else tuple(tree_flatten(out)[0])
        wires.append(tuple(Wire.of(v) for v in values if isinstance(v, Tensor)))
    return wires


class WireStage(nn.Module):
    """One stage as PipelineStage sees it: wire tensors in, wire tensors out.

    ``last`` marks the last stage: its output pytree is flattened to tensor leaves
    and :meth:`unflatten` rebuilds it for the loss. ``recompute`` is set per micro-batch by
    the pipeline (see [Note: distributed recomputation]).
    """

    def __init__(
        self, stage: nn.Module, inputs: Sequence[Wire], outputs: Sequence[Wire], *, last: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.last = last
        self.device = device
        self.recompute = False
        self._spec: TreeSpec | None = None
        self._consts: list[tuple[int, Any]] = []

    def forward(self, *wire: Tensor) -> tuple[Tensor, ...]:
        if self.recompute and torch.is_grad_enabled():
            out: tuple[Tensor, ...] = torch_checkpoint(
                self._run, *wire, use_reentrant=False, preserve_rng_state=True
            )
            return out
        return self._run(*wire)

    def _run(self, *wire: Tensor) -> tuple[Tensor, ...]:
        out = self.stage(*_decode(wire, self.inputs))
        if not self.last:
            return _encode(_as_tuple(out), self.outputs, self.device)
        leaves, self._spec = tree_flatten(out)
        self._consts = [(k, v) for k, v in enumerate(leaves) if not isinstance(v, Tensor)]
        return tuple(v for v in leaves if isinstance(v, Tensor))

    def unflatten(self, tensors: Tensor | tuple[Tensor, ...]) -> Any:
        """The last stage's output as the model returns it, from its tensor leaves."""
        assert self._spec is not None, "unflatten before the last stage ran"
        it = iter(_as_tuple(tensors))
        consts = dict(self._consts)
        leaves = [consts[k] if k in consts else next(it) for k in range(self._spec.num_leaves)]
        return tree_unflatten(leaves, self._spec)


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
_COMMUNICATION_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer")


def _is_communication_error(err: BaseException) -> bool:
    """Gloo and NCCL report a dead or silent peer as RuntimeError (DistError in newer torch)."""
    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(m in text for m in _COMMUNICATION_MARKERS)
class DistributedPipeline:
    """This rank's stages of a pipeline run by a torch.distributed.pipelining schedule.

    Args:
        stages: this rank's stage modules (stage ``i`` takes cut ``i``'s values).
        indices: their global stage indices (rank ``r`` of ``W`` holds ``r, r + W, ...``).
        num_stages: stages in the whole pipeline.
        loss_fn: ``loss_fn(output, target)`` on each micro-batch's output (last stage).
        chunks: micro-batches per mini-batch; the batch size must be a multiple of it.
        checkpoint: ``always``, ``except_last`` or ``never`` (see executor.checkpoint).
        schedule: a key of :data:`SCHEDULES`.
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
        checkpoint: str = "except_last",
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
        if schedule not in SCHEDULES:
            raise DistributedError(f"schedule={schedule!r} is unknown; use one of {sorted(SCHEDULES)}")
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
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.indices = list(indices)
        self.num_stages, self.chunks, self.schedule_name = num_stages, chunks, schedule
        self.timeout = timeout
        self.device = torch.device(device)
        self.key_aliases = key_aliases or {}
        self._steps = 0
        timedelta = datetime.timedelta(seconds=timeout)
        self.group = dist.new_group(backend=dist.get_backend(), timeout=timedelta)
        stop = checkpoint_stop(checkpoint, chunks)
        self.stages = [s.to(self.device) for s in stages]
        self.wire_stages = [
            WireStage(s, wires[i], wires[i + 1], last=i == num_stages - 1, device=self.device)
            for s, i in zip(self.stages, self.indices, strict=True)
        ]
        self.pipeline_stages = [  # static metadata: no inference run on the first step
            _Stage(w, stop, i, num_stages, self.device, input_args=_metas(w.inputs),
                   output_args=_metas(w.outputs), group=self.group)
            for w, i in zip(self.wire_stages, self.indices, strict=True)
        ]
        self._last = next((w for w, i in zip(self.wire_stages, indices, strict=True) if i == num_stages - 1), None)
        self._loss_fn = loss_fn
        kind = SCHEDULES[schedule]
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

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the original model's keys (tied: every key)."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            for key, value in stage.state_dict().items():
                for alias in self.key_aliases.get(key, [key]):
                    out[alias] = value
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
                if not _is_communication_error(err):
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
