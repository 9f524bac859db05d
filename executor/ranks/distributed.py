"""This rank's pipeline stages on torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, and
the zero-bubble schedules: executor/ranks/torch_schedules.py).

    pipe = DistributedPipeline([stage], [rank], world, loss_fn=F.cross_entropy, chunks=8,
                               wires=wires, device=torch.device("cpu"))
    loss = pipe.step(x, target=y)      # the mini-batch loss on the last rank, None elsewhere
    val = pipe.eval_step(x, target=y)  # forward only, dropout off: the loss on the last rank
    out = pipe.eval_step(x)            # ... or the model's output for the batch

Every rank calls ``step`` with the same arguments; only the first stage reads the inputs and
only the last reads the target. Inputs of other sizes than the example's (another sequence
length, another batch) run too: see [Note: one schedule per input size] in executor/ranks/sized.py.

[Note: train, eval and evaluation] ``pipe.train()`` / ``pipe.eval()`` set this rank's stages'
modes as ``nn.Module.train`` / ``eval`` do (the traced graphs read them: dropout, BatchNorm),
and ``step`` runs in whichever mode is set, like a plain model's forward and backward.
``eval_step`` is the evaluation a user expects: forward only (torch's ``schedule.eval``: no
backward, no gradients, under ``torch.no_grad``), with every stage in eval mode for the call
and put back afterwards, returning the mean micro-batch loss when given a target, else the
model's output for the whole batch, gathered as executor.GPipe gathers it: tensors concatenated,
a 0-dim leaf the sum of its micro-batches' values weighted by their counted items if it is the
model's own loss ([Note: a loss the model computes]: the loss ``step`` returns), else by rows.
``step``'s gradients accumulate in the stages' parameters exactly as
``mean(loss_fn(stage_chain(x_i), y_i) for each micro-batch i).backward()`` would leave them,
so the caller steps its own optimizer over :attr:`DistributedPipeline.stage_module`.

[Note: what crosses a cut] is in executor/ranks/wire.py, [Note: tied parameters across ranks]
in executor/ranks/ties.py, [Note: packed rows on ranks] in executor/packed.py.
[Note: distributed recomputation] is in executor/recompute.py, [Note: distributed mixed
precision] in executor/precision.py, [Note: split backward on ranks] (the zero-bubble
schedules) in executor/ranks/split_backward.py.

[Note: a dead rank is an error, not a hang] is in executor/ranks/peer_failures.py: a peer's failure
becomes :class:`PipelineFailure` within the timeout, a hung step ends the process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from executor.checkpoint import Checkpointable, CheckpointView
from executor.decision import Decision, runtime_decision
from executor.errors import DistributedError
from executor.grad_norm import clip_grads_, counted_once
from executor.keywords import InputSignature
from executor.microbatch import gather
from executor.model_loss import ModelLoss, weighted
from executor.packed import unpadded
from executor.precision import precision_autocast
from executor.ranks.peer_failures import PipelineFailure, peer_failures
from executor.ranks.rank_state import PART_METADATA, rank_checkpoint_view, rank_state_dict
from executor.ranks.sized import SizedSchedules
from executor.ranks.step_inputs import bind_inputs, schedule_for
from executor.ranks.ties import sum_tied_grads, tied_grads
from executor.ranks.torch_schedules import build_schedule, check_layout, schedule_class
from executor.ranks.watchdog import FIRST_STEP_TIMEOUT_S, WATCHDOG_EXIT_CODE, StepLimits, StepWatch
from executor.ranks.wire import Wire, WireStage, infer_wires
from executor.recompute import recompute_stop
from executor.spec import MULTI_STAGE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, renamed_recompute

__all__ = ["schedule_class", "DistributedError", "PipelineFailure", "Wire", "WireStage", "infer_wires",
           "DistributedPipeline", "WATCHDOG_EXIT_CODE"]

# --- the pipeline -----------------------------------------------------------------------------
class DistributedPipeline(Checkpointable):
    """This rank's stages of a pipeline run by a torch.distributed.pipelining schedule.

    Args:
        stages: this rank's stage modules (stage ``i`` takes cut ``i``'s values).
        indices: their global stage indices (rank ``r`` of ``W`` holds ``r, r + W, ...``).
        num_stages: stages in the whole pipeline (default: the decision's).
        decision: a plan's :class:`executor.Decision` (``plan.decision``, with this run's
            overrides) instead of ``chunks``, ``recompute``, ``schedule``, ``precision`` and
            ``merge_backward``, which must then be left out ([Note: a plan's decision] in
            executor/decision.py).
        loss_fn: ``loss_fn(output, target)`` on each micro-batch's output (last stage), or a
            :class:`executor.model_loss.ModelLoss`: the model returns its own loss, weighted
            per micro-batch by its counted items, known before the schedule runs ([Note: a loss
            the model computes]); ``step`` then takes no target, and the last rank needs the
            inputs too (it counts the items from them).
        signature: the keyword inputs ``step`` and ``eval_step`` take ([Note: keyword inputs
            are positional inside] in executor/keywords.py).
        chunks: micro-batches per mini-batch (default 8); the batch size must be a multiple of it.
        recompute: ``always``, ``except_last`` or ``never``, or a list with one of them for
            each of the ``num_stages`` stages (see [Note: distributed recomputation]).
        schedule: one of executor.spec.SCHEDULES.
        wires: the wires of every cut, from :func:`infer_wires` (the same on every rank).
        ties: one ``(ranks, parameter or None)`` per parameter held by several ranks, in the
            same order on every rank: the ranks holding a copy (or a process group of them,
            None where this rank holds none), and this rank's copy.
        key_aliases: a state_dict key -> every key of the original model naming that tensor.
        device: where this rank's stages run.
        timeout: seconds a step may take before a silent peer is an error: the watchdog then
            ends this process with ``os._exit(WATCHDOG_EXIT_CODE)`` ([Note: a dead rank is an
            error, not a hang]); None turns the watchdog off.
        first_step_timeout: the same for the first step, which builds, warms up and may compile
            ([Note: the first step's own limit]); None: ``timeout`` for it too.
        group: the pipeline's process group (a mesh's "pp" group, created with the first
            step's limit); default: a new group of every rank.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: autocast in every stage call
            and the loss, fp32 parameters and gradients ([Note: distributed mixed precision]);
            pass wires inferred with the same ``precision`` (``infer_wires(..., precision=)``).
        merge_backward: under a zero-bubble schedule, which adjacent halves of a split backward
            run whole: ``"unwaited"`` (default) or ``"adjacent"`` (executor.spec.MERGE_RULES,
            [Note: adjacent I and W]); a plan's ``merge_backward``. The gradients are the same.
    """

    dp_rank, dp_size = 0, 1  # one replica; executor.ranks.replicated.ReplicatedPipeline has more
    tp_group: dist.ProcessGroup | None = None  # a stage split over a TP group: its group and place
    tp_rank = 0  # ([Note: tensor parallelism on ranks], set by autopipe.distributed_pipeline)

    def __init__(
        self,
        stages: Sequence[nn.Module],
        indices: Sequence[int],
        num_stages: int | None = None,
        *,
        decision: Decision | None = None,
        loss_fn: Callable[[Any, Any], Tensor] | ModelLoss,
        signature: InputSignature | None = None,
        chunks: int | None = None,
        recompute: str | Sequence[str] = "except_last",
        schedule: str = "gpipe",
        wires: Sequence[Sequence[Wire]],
        ties: Sequence[tuple[Sequence[int] | dist.ProcessGroup | None, nn.Parameter | None]] = (),
        key_aliases: dict[str, list[str]] | None = None,
        device: torch.device | str = "cpu",
        timeout: float | None = 60.0,
        first_step_timeout: float | None = FIRST_STEP_TIMEOUT_S,
        group: dist.ProcessGroup | None = None,
        precision: str = "fp32",
        merge_backward: str = "unwaited",
        checkpoint: str | Sequence[str] | None = None,  # recompute's old name, until the next release
    ) -> None:
        recompute = renamed_recompute(recompute, checkpoint, "DistributedPipeline")
        if not dist.is_initialized():
            raise DistributedError("torch.distributed is not initialized; call "
                                   "torch.distributed.init_process_group(...) on every rank first")
        if num_stages is None:
            if decision is None:
                raise DistributedError("num_stages is missing: pass the pipeline's stage count, or "
                                       "decision=plan.decision")
            num_stages = decision.num_stages
        try:  # checked once, as one value ([Note: a plan's decision] in executor/decision.py)
            self.decision = runtime_decision(
                decision, num_stages, chunks=chunks if chunks is not None or decision is not None else 8,
                recompute=recompute, schedule=schedule, precision=precision, merge_backward=merge_backward)
        except ValueError as err:
            raise DistributedError(str(err)) from None
        chunks, schedule = self.decision.chunks, self.decision.schedule
        kind = schedule_class(schedule)
        if len(stages) != len(indices) or not stages:
            raise DistributedError(f"got {len(stages)} stages for {len(indices)} indices; pass one index per stage")
        if len(stages) > 1 and schedule not in MULTI_STAGE_SCHEDULES:
            raise DistributedError(f"schedule={schedule!r} runs one stage per rank but this rank has "
                                   f"{len(stages)}; use schedule='interleaved1f1b'")
        if len(wires) != num_stages + 1:
            raise DistributedError(f"got wires for {len(wires)} cuts but {num_stages} stages have "
                                   f"{num_stages + 1}; pass infer_wires(all_stages, micro_batch)")
        self.recompute_modes = list(self.decision.recompute)  # every stage's
        self.precision, self.merge_backward = self.decision.precision, self.decision.merge_backward
        check_layout(schedule, num_stages, dist.get_world_size(group), chunks, dist.get_rank(group), indices)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)  # in the pipeline
        self.pp_rank, self.pp_size = self.rank, self.world
        self.indices = list(indices)
        self.num_stages, self.chunks, self.schedule_name = num_stages, chunks, schedule
        self.limits = StepLimits(timeout, first_step_timeout)
        self.timeout = timeout
        self._watch = StepWatch(self.limits, self._failure, self._groups)
        self.device = torch.device(device)
        self.key_aliases = key_aliases or {}
        self.steps = 0  # training steps run (step calls): a checkpoint's default step
        timedelta = self.limits.group_timeout
        self.group = group if group is not None else dist.new_group(backend=dist.get_backend(), timeout=timedelta)
        self.stages = [s.to(self.device) for s in stages]
        self.wire_stages = [
            WireStage(s, wires[i], wires[i + 1], first=i == 0, last=i == num_stages - 1, device=self.device,
                      precision=self.precision, split=schedule in ZERO_BUBBLE_SCHEDULES)
            for s, i in zip(self.stages, self.indices, strict=True)
        ]
        where = {id(p): (k, n) for k, s in enumerate(self.stages) for n, p in s.named_parameters()}
        tied_at = [None if p is None else where[id(p)] for _, p in ties]
        modules = [self._replicate(w) for w in self.wire_stages]  # FSDP may replace parameters
        self._last = next((w for w, i in zip(self.wire_stages, indices, strict=True) if i == num_stages - 1), None)
        self._loss_fn = loss_fn
        self._counted = 0.0  # the items this step's batch counts, for the model's own loss (bind_inputs)
        self._share = 1.0  # of each micro-batch's loss, what its backward takes: 1 / chunks in a step
        self._num_items: float | None = None  # the step's num_items_in_batch, if given (bind_inputs)
        self._packed: list[int] | None = None  # a packed row's micro-batch sizes (bind_inputs)
        self.signature = signature
        self._no_target = False  # eval_step without a target: the schedule's loss is a dummy
        self._scaler: torch.amp.GradScaler | None = None  # step(scaler=)'s, for _loss
        self._outputs: list[Any] = []  # ... and each micro-batch's output is kept instead
        self.wires = [tuple(cut) for cut in wires]

        def make_schedule(stages: list[Any]) -> Any:
            return build_schedule(kind, schedule, stages, chunks, self._loss, self.merge_backward)

        self._sized = SizedSchedules(self.wire_stages, self.indices, num_stages, wires, make_schedule,
                                     recomputed=[recompute_stop(self.recompute_modes[i], chunks)
                                                 for i in self.indices], chunks=chunks,
                                     device=self.device,
                                     group=self.group, modules=modules)
        self._schedule = self._sized.get(self._sized.example)
        self._ties = [(dist.new_group(ranks=sorted(r), timeout=timedelta) if isinstance(r, Sequence) else r,
                       None if at is None else self.stages[at[0]].get_parameter(at[1]))
                      for (r, _), at in zip(ties, tied_at, strict=True)]

    def _replicate(self, wire: WireStage) -> nn.Module:
        """What PipelineStage runs for ``wire``: itself here, a data-parallel wrapper in replicas."""
        return wire

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

    PART_METADATA = PART_METADATA  # see [Note: checkpoint parts] in executor/ranks/rank_state.py

    def state_dict(self) -> dict[str, Any]:
        """This rank's parameters and buffers under the original model's keys (tied: every key),
        which part of which pipeline it is in its ``_metadata`` ([Note: checkpoint parts])."""
        return rank_state_dict(self)

    def _checkpoint_view(self) -> CheckpointView:
        return rank_checkpoint_view(self)

    @property
    def training(self) -> bool:
        """Whether this rank's stages are in train mode (see [Note: train, eval and evaluation])."""
        return all(s.training for s in self.stages)

    def train(self, mode: bool = True) -> DistributedPipeline:
        """Set this rank's stages to train (or eval) mode, as ``nn.Module.train`` does."""
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> DistributedPipeline:
        """Set this rank's stages to eval mode (dropout off), as ``nn.Module.eval`` does."""
        return self.train(False)

    def _loss(self, output: Any, target: Any) -> Tensor:
        assert self._last is not None
        if self._no_target:  # eval_step(x): the outputs are gathered here, the loss is a dummy
            self._outputs.append(self._last.unflatten(output))
            return torch.zeros((), device=self.device)
        with precision_autocast(self.precision, self.device):  # the last stage's work
            if isinstance(self._loss_fn, ModelLoss):  # target: this micro-batch's weight x chunks
                loss = weighted(self._loss_fn.pick(self._last.unflatten(output)), target)
            else:
                loss = self._loss_fn(self._last.unflatten(output), target)
        loss = loss * self._share  # [Note: a step adds its own gradients]
        return loss if self._scaler is None else self._scaler.scale(loss)

    def step(self, *inputs: Any, target: Any = None, scaler: torch.amp.GradScaler | None = None,
             **keywords: Any) -> Tensor | None:
        """Run one mini-batch forward and backward; the mean micro-batch loss on the last rank.
        Gradients add to those already there, as a backward call's do ([Note: a step adds its
        own gradients]). ``scaler`` (a PipelineGradScaler) scales each micro-batch's loss in the
        schedule; the loss returned is unscaled ([Note: loss scaling on ranks] in
        executor/ranks/grad_scaler.py). ``num_items_in_batch=N``: the model's own loss over N
        items (executor/ranks/step_inputs.py)."""
        inputs, target = bind_inputs(self, inputs, keywords, target)
        self.steps += 1
        self._scaler = scaler  # read by _loss
        losses: list[Tensor] = []
        for wire in self.wire_stages:
            if wire.weight_grads is not None:  # [Note: split backward on ranks]
                wire.weight_grads.clear()
        with self._watchdog(), self._peer_failures():
            target = self._replica_weights(target)
            schedule = self._schedule = schedule_for(self, inputs, target, need_target=True)
            before = tied_grads(self._ties)
            self._share = 1.0 / self.chunks
            try:
                schedule.step(*(inputs if self.is_first else ()), target=target if self.is_last else None,
                              losses=losses if self.is_last else None, return_outputs=False)
            finally:
                self._share = 1.0
            self._finish_grads(before)
            # each loss is already its micro-batch's share: their sum is the mean
            mean = self._replica_loss(torch.stack([x.detach() for x in losses]).sum()) if self.is_last else None
        return mean if mean is None or scaler is None else mean / scaler.get_scale()

    def _replica_weights(self, target: Any) -> Any:
        """The schedule's targets as this pipeline's only replica weighs them: unchanged."""
        return target

    def _replica_loss(self, mean: Tensor) -> Tensor:
        """The step's loss as this pipeline's only replica reports it: its own."""
        return mean

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """Clip as ``torch.nn.utils.clip_grad_norm_`` on the plain model; its total norm, the same
        on every rank ([Note: one norm over stages and ranks] in executor/grad_norm.py). A
        collective: call it on every rank, after ``step`` (and ``scaler.unscale_``)."""
        counted, copies = counted_once((p for s in self.stages for p in s.parameters()), self._ties)
        with self._peer_failures():
            return clip_grads_(counted, copies, max_norm, norm_type, error_if_nonfinite,
                               device=self.device, shard_group=self._shard_group(), groups=[self.group],
                               tp_group=self.tp_group)

    def _shard_group(self) -> dist.ProcessGroup | None:
        """The group a gradient's shards are spread over (a replicated pipeline's under FSDP)."""
        return None

    def found_inf_groups(self) -> list[dist.ProcessGroup]:
        """Groups whose all-reduces, one after another, reach every rank of this pipeline and its
        replicas: this pipeline's (a replicated pipeline adds its "dp" group)."""
        return [self.group]

    def eval_step(self, *inputs: Any, target: Any = None, **keywords: Any) -> Any:
        """Forward only, in eval mode, without gradients (see [Note: train, eval and evaluation]).

        On the last rank: the mean micro-batch loss when ``target`` is given, else the model's
        output for the whole batch (its own loss weighted as ``step`` weights it); None on the
        other ranks. Call it on every rank.
        """
        inputs, target = bind_inputs(self, inputs, keywords, target)
        counted = None  # the model's own loss: each micro-batch's weight x chunks, from bind_inputs
        if isinstance(self._loss_fn, ModelLoss) and self.is_last:
            counted, target = target, None
        modes = [(m, m.training) for s in self.stages for m in s.modules()]
        losses: list[Tensor] = []
        self._outputs = []
        try:  # not counted in steps: checkpoint parts record training steps
            self.eval()
            self._no_target, self._scaler = target is None, None
            with self._watchdog(), self._peer_failures(), torch.no_grad():
                schedule = self._schedule = schedule_for(self, inputs, target, need_target=False)
                dummy = torch.zeros(self.chunks, device=self.device)  # split per micro-batch, unread
                schedule.eval(*(inputs if self.is_first else ()),
                              target=(dummy if target is None else target) if self.is_last else None,
                              losses=losses if self.is_last else None, return_outputs=False)
        finally:
            self._no_target = False
            for m, mode in modes:
                m.training = mode
        outputs, self._outputs = self._outputs, []
        if not self.is_last:
            return None
        if target is not None:
            return torch.stack(losses).mean()
        rows: list[Tensor | float] = [1.0 / self.chunks] * self.chunks  # equal micro-batches
        leaf = self._loss_fn.leaf if isinstance(self._loss_fn, ModelLoss) else -1
        items = rows if counted is None else list(counted / self.chunks)
        out = gather(outputs, lambda k: items if k == leaf else rows)
        return out if self._packed is None else unpadded(out, self._packed)

    def _peer_failures(self) -> AbstractContextManager[None]:
        return peer_failures(self._failure)

    # [Note: a step adds its own gradients] Gradients accumulate over steps as over backward
    # calls (a caller accumulating micro-steps into one optimizer step, HF's
    # num_items_in_batch), so a step may change only what it adds: each micro-batch's loss is
    # back-propagated as its 1/chunks share (``_share`` in ``_loss``), not divided out of every
    # gradient after the schedule, which also divided what earlier steps had left; and a tied
    # parameter's copies add up across ranks this step's gradient only (``tied_grads`` in
    # executor/ranks/ties.py keeps what was there before). DDP and FSDP average replicas that
    # hold the same earlier gradient, which leaves it as it was.
    def _finish_grads(self, before: Sequence[Tensor | None] = ()) -> None:
        """Sum this step's gradient of each tied parameter over its copies on other ranks."""
        sum_tied_grads(self._ties, before)

    def _who(self) -> str:
        return f"rank {self.rank}/{self.world}"

    def _failure(self, cause: str) -> str:
        return (f"{self._who()}: pipeline step {self.steps} ({self.schedule_name}, "
                f"stages {self.indices}) failed: a peer rank died, hung or failed ({cause}); "
                "see that rank's log")

    def _groups(self) -> list[dist.ProcessGroup]:
        """Every process group this pipeline talks on (a mesh adds its "dp" group)."""
        return [self.group, *(g for g, _ in self._ties if g is not None)]

    def _watchdog(self) -> AbstractContextManager[None]:  # [Note: one watchdog thread]
        return self._watch.step()
