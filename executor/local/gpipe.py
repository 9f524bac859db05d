"""GPipe in one process: stages on devices, micro-batches in fill-drain order.

``GPipe(stages, devices, chunks)`` runs ``stages`` as a linear chain (DESIGN.md "Stages are a
linear chain"): stage 0 is called as ``stage0(*inputs)`` on each micro-batch, stage ``j + 1``
with ``*out`` if stage ``j`` returned a tuple, else with ``out``; non-tensor values pass
through. The last stage's outputs are concatenated along dim 0.

Forward follows :func:`executor.local.fill_drain.clock_cycles`: at each clock the pipeline first
*fences* (orders micro-batch ``i - 1`` behind ``i`` for backward, copies inputs across devices
on copy streams) and then *computes* (one task per (micro-batch, stage) on that device's
worker). Backward is plain autograd over the graph this built, which the fences make run in
reverse fill-drain order. (Structure after torchgpipe's ``pipeline.py``; own code.)

[Note: state_dict keys] Stages are usually torch.fx GraphModules split from one model, whose
submodule paths equal the model's qualified names. GPipe's ``state_dict`` is therefore the union
of its stages' ``state_dict``s without a ``stages.N.`` prefix (a tied parameter appears once),
and ``load_state_dict`` accepts the original model's ``state_dict`` and reports missing and
unexpected keys and size mismatches under the original keys, as the model itself would. Which
keys a stage saves is the stage's business (autopipe's stages save exactly what the model does:
autopipe/frontend/building/stages.py [Note: a stage saves what the model saves]). Stages whose local
names differ (e.g. slices of ``model.net``, an ``nn.Sequential``) take ``key_prefixes``: one
string per stage prepended to its local keys (``"net."``).

Placement, and [Note: ties across devices], are in executor/local/placement.py. Mixed precision
(``precision=``, and the caller's own ``with torch.autocast(...)``): [Note: mixed precision]
and [Note: autocast follows the stage] in executor/precision.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from executor.checkpoint import Checkpointable, CheckpointView
from executor.decision import Decision, runtime_decision
from executor.errors import ExecutorError
from executor.grad_norm import clip_grads_
from executor.keywords import InputSignature
from executor.local.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from executor.local.fill_drain import clock_cycles
from executor.local.placement import check_devices, check_move, place
from executor.local.stage_task import MicroBatchLoss, StageTask
from executor.local.state_keys import (
    original_keys,
    prefix_state_dict,
    unprefix_incompatible_keys,
    unprefix_state_dict,
)
from executor.local.stream import (
    AbstractStream,
    copy,
    current_stream,
    new_stream,
    use_device,
    use_stream,
    wait,
)
from executor.local.timeline import TimelineRecorder
from executor.local.worker import WorkerPool
from executor.microbatch import Batch, batch_size, gather, scatter
from executor.model_loss import ModelLoss, row_weights
from executor.packed import POSITIONS, check_separators, gather_packed, packed_sizes, split_packed
from executor.recompute import Checkpointing, depend, recompute_stop
from executor.spec import TimelineEvent, renamed_recompute

__all__ = ["GPipe"]


class GPipe(Checkpointable, nn.Module):
    """Pipeline-parallel ``nn.Module`` over hand-made or planner-made stages.

    Args:
        stages: the chain of stage modules (see the module docstring for the convention).
        devices: one device per stage; stages on the same device share a worker.
        chunks: micro-batches per mini-batch (exactly ``chunks``; see executor.microbatch).
            Required unless ``decision`` is given.
        recompute: ``"always"``, ``"except_last"`` (every micro-batch but the last is
            recomputed in backward) or ``"never"``, or a list with one of them per stage
            ([Note: per-stage recomputation] in executor/spec.py). No recomputation in eval
            or under no_grad.
        decision: a plan's :class:`executor.Decision` (``plan.decision``) instead of ``chunks``,
            ``recompute`` and ``precision``, which must then be left out ([Note: a plan's
            decision] in executor/decision.py); its schedule must be ``gpipe``.
        deferred_batch_norm: convert BatchNorm layers so running statistics advance once per
            mini-batch, as in the unpipelined model.
        key_prefixes: per stage, a prefix mapping its local ``state_dict`` keys to the
            original model's (see [Note: state_dict keys]); ``None``: keys are already original.
        record_timeline: record the timeline (executor.spec.TimelineEvent spans) of every
            iteration (read it from ``last_timeline``).
        threads: run stages on worker threads (True), inline in the caller (False), or
            ``None``: threads only when the stages span two or more devices (see
            [Note: inline worker] in executor.local.worker).
        signature: the keyword inputs ``forward`` takes, after its positional ones
            ([Note: keyword inputs are positional inside] in executor/keywords.py).
        loss_fn: ``loss_fn(output, target)`` computed by the last stage on each micro-batch's
            output: ``pipe(*inputs, target=y)`` then returns the losses weighted by the
            micro-batches' rows (the whole batch's loss for a mean loss), as
            executor.ranks.distributed's ``step`` does; ``target`` is then no keyword input.
        model_loss: the output leaf that is the model's own mean loss, weighted per
            micro-batch by its counted items ([Note: a loss the model computes] in
            executor/model_loss.py); every other 0-dim output is weighted by rows.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: every stage call (and its
            recomputation) runs under ``torch.autocast`` to that dtype on its device, while the
            parameters and their gradients stay fp32 ([Note: mixed precision] in
            executor/precision.py). The caller's own autocast is honoured on every worker and
            in every recomputation either way. fp16 needs loss scaling:
            ``torch.amp.GradScaler`` works on a GPipe as on a plain model.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int],
        chunks: int | None = None,
        recompute: str | Sequence[str] = "except_last",
        deferred_batch_norm: bool = False,
        *,
        decision: Decision | None = None,
        key_prefixes: Sequence[str] | None = None,
        record_timeline: bool = False,
        threads: bool | None = None,
        loss_fn: Callable[[Any, Any], Tensor] | None = None,
        signature: InputSignature | None = None,
        model_loss: ModelLoss | None = None,
        precision: str = "fp32",
        checkpoint: str | Sequence[str] | None = None,  # recompute's old name, until the next release
    ) -> None:
        recompute = renamed_recompute(recompute, checkpoint, "GPipe")
        super().__init__()
        self.loss_fn, self.signature, self.model_loss = loss_fn, signature, model_loss
        stages = list(stages)
        if not stages:
            raise ExecutorError("stages is empty: a pipeline needs at least one stage module")
        try:
            self.decision = runtime_decision(decision, len(stages), chunks=chunks, recompute=recompute,
                                             precision=precision)
        except ValueError as err:
            raise ExecutorError(str(err)) from None
        if self.decision.schedule != "gpipe":
            raise ExecutorError(f"executor.GPipe runs schedule='gpipe' only, not {self.decision.schedule!r}; "
                                "run that schedule on ranks: autopipe.distributed_pipeline(...)")
        if key_prefixes is not None and len(key_prefixes) != len(stages):
            raise ExecutorError(
                f"got {len(key_prefixes)} key_prefixes for {len(stages)} stages: "
                'pass one prefix per stage ("" for none)'
            )
        self.devices = check_devices(devices, len(stages))
        self.chunks, self.precision = self.decision.chunks, self.decision.precision
        self.threads = threads
        self.recompute_modes = list(self.decision.recompute)  # one mode per stage
        # one mode when every stage shares it, else one per stage (as a plan stores it)
        self.recompute: str | list[str] = (self.recompute_modes[0] if len(set(self.recompute_modes)) == 1
                                           else self.recompute_modes)
        self.key_prefixes = list(key_prefixes) if key_prefixes is not None else [""] * len(stages)
        self._deferred: list[DeferredBatchNorm] = []
        if deferred_batch_norm:
            for j, stage in enumerate(stages):
                stages[j], layers = convert_deferred_batch_norm(stage)
                self._deferred += layers
        self._remotes = place(stages, self.devices)
        self.stages = nn.ModuleList(stages)
        self._copy_streams: dict[tuple[torch.device, int], AbstractStream] = {}
        self._always_record = record_timeline
        self._recorder: TimelineRecorder | None = None
        self._recording = False
        self._load_prefix = ""
        self._load_errors: list[str] = []
        self.steps = 0  # training mini-batches run: a checkpoint's default step
        self.register_state_dict_post_hook(unprefix_state_dict)
        self.register_load_state_dict_pre_hook(prefix_state_dict)
        self.register_load_state_dict_post_hook(unprefix_incompatible_keys)

    def __len__(self) -> int:
        return len(self.stages)

    # --- timeline --------------------------------------------------------------------------

    @contextmanager
    def record_timeline(self) -> Iterator[list[TimelineEvent]]:
        """Record the timeline of the iteration run inside the context; the list is filled on exit."""
        events: list[TimelineEvent] = []
        old, self._recording, self._recorder = self._recording, True, None
        try:
            yield events
        finally:
            self._recording = old
            events += self.last_timeline or []

    @property
    def last_timeline(self) -> list[TimelineEvent] | None:
        """The timeline of the last recorded iteration (read it after backward)."""
        return None if self._recorder is None else self._recorder.events()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every stage's parameters, each once (on the
        first stage's device; see [Note: one norm over stages and ranks] in executor/grad_norm.py)."""
        grads = [p.grad for p in self.parameters()]
        return clip_grads_(grads, (), max_norm, norm_type, error_if_nonfinite, device=self.devices[0])

    def _checkpoint_view(self) -> CheckpointView:
        """Every tensor under its original key(s), a tie's other copies refreshed after a load."""
        by_id: dict[int, tuple[Tensor, list[str]]] = {}
        for key, tensor in self.state_dict(keep_vars=True).items():
            by_id.setdefault(id(tensor), (tensor, []))[1].append(key)
        held = {**dict(self.named_parameters(remove_duplicate=False)),
                **dict(self.named_buffers(remove_duplicate=False))}
        owners = [[held[k] for k in locals_ if k in held]
                  for locals_ in original_keys(self).values() if len(locals_) > 1]

        def copy_ties() -> None:
            with torch.no_grad():
                for first, *others in owners:
                    for other in others:
                        if other is not first:
                            other.copy_(first)

        return CheckpointView(names=list(by_id.values()), devices=list(self.devices),
                              about={"runtime": "GPipe", "num_stages": len(self.stages), "chunks": self.chunks},
                              after_load=copy_ties if owners else None)

    # --- forward -------------------------------------------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> GPipe:  # [Note: a pipeline stays where it was placed]
        check_move(self.devices, args, kwargs, "pipe.to(...)")
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> GPipe:
        check_move(self.devices, ("cuda" if device is None else device,), {}, "pipe.cuda()")
        return super().cuda(device)

    def cpu(self) -> GPipe:
        check_move(self.devices, ("cpu",), {}, "pipe.cpu()")
        return super().cpu()

    def forward(self, *inputs: Any, **keywords: Any) -> Any:
        # the model's own loss over the items of every batch a step accumulates (HF's loss kwarg)
        num_items = keywords.pop("num_items_in_batch", None) if self.model_loss is not None else None
        target = keywords.pop("target", None) if self.loss_fn is not None else None
        if self.signature is not None:
            inputs = self.signature.bind(inputs, keywords)
        elif keywords:
            raise ExecutorError(f"keyword input {next(iter(keywords))!r}: GPipe takes keyword "
                                "inputs only with signature=InputSignature(...)")
        for remote in self._remotes:
            remote.fetch()
        packed = self._packed_sizes(inputs)  # [Note: packed rows split at sequence starts]
        batches = scatter(inputs, self.chunks) if packed is None else \
            [Batch(p) for p in split_packed(inputs, packed)]
        targets = self._targets(target, packed)
        weights = self._scalar_weights([b.values for b in batches], num_items, packed)
        first = self.devices[0]
        batches = [b.with_tensors([t.to(first) for t in b.tensors()]) for b in batches]
        recorder = TimelineRecorder() if (self._recording or self._always_record) else None
        if recorder is not None:
            self._recorder = recorder
        enabled = self.training and torch.is_grad_enabled()
        stops = [recompute_stop(mode, self.chunks, enabled=enabled) for mode in self.recompute_modes]
        try:
            with WorkerPool(self.devices, self.threads) as pool:
                for cycle in clock_cycles(len(batches), len(self.stages)):
                    self._fence(cycle, batches, recorder)
                    self._compute(cycle, batches, pool, stops, recorder, targets)
        except BaseException:
            for bn in self._deferred:
                bn.reset_tracking()
            raise
        if self.training:
            for bn in self._deferred:
                bn.commit()
        if enabled:
            self.steps += 1
        outputs = [b.output() for b in batches]
        return gather(outputs, weights) if packed is None else gather_packed(outputs, weights)

    def _packed_sizes(self, inputs: tuple[Any, ...]) -> list[int] | None:
        """Each micro-batch's tokens when ``inputs`` are one packed row (a batch of one row with
        ``position_ids``, more than one micro-batch); None for a batch split by rows."""
        if self.signature is None or POSITIONS not in self.signature.keywords or self.chunks == 1 \
                or batch_size(inputs) != 1:
            return None
        positions = inputs[self.signature.positional + self.signature.keywords.index(POSITIONS)]
        sizes = packed_sizes(positions, self.chunks)
        if self.model_loss is not None:  # the model's own count of its loss items, whole and cut
            check_separators(self.model_loss, inputs, split_packed(inputs, sizes))
        return sizes

    def _targets(self, target: Any, packed: list[int] | None) -> list[Any] | None:
        """``target=`` split like the inputs, one per micro-batch, on the last device."""
        if self.loss_fn is None:
            return None
        if target is None:
            raise ExecutorError("this pipeline computes loss_fn(output, target): call it as "
                                "pipe(*inputs, target=y)")
        last = self.devices[-1]
        parts = scatter((target,), self.chunks) if packed is None else \
            [Batch(p) for p in split_packed((target,), packed)]
        return [b.with_tensors([t.to(last) for t in b.tensors()]).values[0] for b in parts]

    def _scalar_weights(self, inputs: list[tuple[Any, ...]], num_items: Any = None,
                        packed: list[int] | None = None) -> Any:
        """Each 0-dim output leaf's weight per micro-batch ([Note: a loss the model computes]);
        ``num_items``: the model's loss is over that many items, not the batch's own count;
        a packed row's micro-batches weigh by tokens, not rows."""
        rows = row_weights(packed if packed is not None else [batch_size(b) for b in inputs])
        loss = self.model_loss
        if loss is None:
            return lambda k: rows
        counted = loss.weights(inputs, None if num_items is None else float(num_items))
        return lambda k: counted if k == loss.leaf else rows

    def _copy_stream(self, j: int, i: int) -> AbstractStream:
        """Micro-batch ``i``'s copy stream on stage ``j``'s device (one per pair, lazily)."""
        key = (self.devices[j], i)
        if key not in self._copy_streams:
            self._copy_streams[key] = new_stream(self.devices[j])
        return self._copy_streams[key]

    def _crosses(self, j: int) -> bool:
        """Whether stage ``j``'s input comes from another device."""
        return j > 0 and self.devices[j - 1] != self.devices[j]

    def _fence(
        self, cycle: list[tuple[int, int]], batches: list[Batch], recorder: TimelineRecorder | None
    ) -> None:
        for i, j in cycle:
            if i > 0:  # micro-batch i-1 back-propagates through stage j after micro-batch i
                batches[i - 1], batches[i] = depend(batches[i - 1], batches[i])
            if self._crosses(j):
                span = (
                    recorder.span(j, i, "transfer", self.devices[j], self._copy_stream(j, i))
                    if recorder
                    else nullcontext()
                )
                with span:
                    batches[i] = copy(
                        batches[i], self._copy_stream(j - 1, i), self._copy_stream(j, i)
                    )

    def _compute(
        self,
        cycle: list[tuple[int, int]],
        batches: list[Batch],
        pool: WorkerPool,
        stops: list[int],
        recorder: TimelineRecorder | None,
        targets: list[Any] | None = None,
    ) -> None:
        last = len(self.stages) - 1
        streams = [current_stream(d) for d in self.devices]
        futures: list[tuple[int, int, Future[tuple[Batch, Checkpointing | None]]]] = []
        for i, j in cycle:
            batch = batches[i]
            if self._crosses(j):  # compute only after the copy has landed
                batch = wait(batch, self._copy_stream(j, i), streams[j])
            loss = None if targets is None or j != last else MicroBatchLoss(self.loss_fn, targets[i])
            task = StageTask(
                self.stages[j], j, i, self.devices[j], streams[j], batch, i < stops[j], recorder,
                loss,
                self.precision,
            )
            futures.append((i, j, pool.submit(j, task)))
        error: BaseException | None = None
        for i, j, future in futures:
            try:
                out, chk = future.result()
            except BaseException as exc:  # keep draining; raise the first failure
                error = error or exc
                continue
            with use_device(self.devices[j]), use_stream(streams[j]):
                if j != last and self._crosses(j + 1):  # the copy starts after compute
                    out = wait(out, streams[j], self._copy_stream(j, i))
                if chk is not None:
                    out = chk.recompute(out)
            batches[i] = out
        if error is not None:
            raise error


# --- state_dict in the original model's keys (see [Note: state_dict keys]) -----------------
