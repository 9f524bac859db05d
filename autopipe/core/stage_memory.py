"""A stage's activation memory: the walk over its schedule's order, as terms the solvers bound.

[Note: stage memory] (the rest of a stage's memory, its parameter state, is in cost.py) A
stage's activations of one micro-batch are its ``saved_bytes``. Checkpointing follows
torchgpipe, per stage ([Note: per-stage recomputation] in executor/spec.py): ``always``
checkpoints all M micro-batches, ``except_last`` all but the one back-propagated first,
``never`` none; the checkpointed ones are the R whose backward comes last ([Note: which
micro-batches recompute] in executor/spec.py). A checkpointed micro-batch keeps only its stage
input from its forward until its backward, which first recomputes the forward (``saved_bytes``
again) and then frees both; any other micro-batch keeps ``saved_bytes`` from its forward to the
end of its backward. Under the zero-bubble schedules ([Note: split backward] in
autopipe/core/zero_bubble.py) the backward is two operations: the input-gradient part I (with the
recomputation, where the micro-batch is checkpointed) frees nothing, since torch retains the
graph for W, and adds what W starts from (``weight_held_bytes``: the gradients at the weights'
nodes, and the output gradient the stage received); the weight-gradient part W frees all of it.

[Note: an input kept once] A checkpointed micro-batch keeps its stage input, and when it is
recomputed the stage's first layer saves part of that input again (a Linear's input, a norm's):
one tensor, held once, not an input plus a save. ``input_saved_bytes`` is that part (the first
layer's ``saved_input_bytes`` in the profile); while d micro-batches are recomputed and not yet
freed, the level is d x ``input_saved_bytes`` lower than the two counted apart. Only the first
layer is asked: a later layer of the stage that saves a received value too (a skip) is still
counted twice, on the safe side.

Walking the stage's operations in its schedule's order ([Note: schedule orders] in
autopipe/core/schedules.py) with these rules (``_held``) gives the level after every allocation
as ``a x input_bytes + b x saved_bytes + c x weight_held_bytes - d x input_saved_bytes`` (c is 0
where no backward is split, d where nothing recomputes as a whole); the peak is the largest,
over the few Pareto-maximal (a, b, c, d) terms (``activation_terms``; a smaller d is the larger
level). That is exact for the order the schedule runs, whatever the stage's bytes: GPipe with R
of M checkpointed peaks at ``R x input + max(M - R, 1) x saved`` (``M x saved`` for R = 0)
less one ``input_saved`` where R = M, 1F1B at stage s holds at most ``min(M, K - s)``
micro-batches.
executor.GPipe (one process) back-propagates in the reverse order and checkpoints the
mirror-image micro-batches, so the same formula is exact for it
(benchmarks/memory_vs_prediction.py counts it). The simulator walks the order it ran, so its
peaks equal these (tests/core/test_simulator.py).

[Note: the loss's memory] The last stage holds more than its layers' saves: from a micro-batch's
forward to its backward, the runtime keeps the model's output (torch.distributed.pipelining's
stage for the backward it starts; executor.GPipe gathers every micro-batch's for the caller's
loss), and the loss keeps what it saved (cross-entropy's log-softmax, the size of the logits);
while the loss back-propagates, its gradients are alive besides. The profile counts the output
(the ``output_bytes`` of the layers nothing reads) and the loss's bytes on one micro-batch
(``LossCost.held_bytes`` / ``peak_bytes``, counted as live storage:
autopipe/frontend/profiling/corrections/loss_timing.py). ``LayerCosts.loss_kept`` is charged
once per micro-batch the stage holds (``stage_memory.loss_bytes``); the gradients
(``loss_grads``) once on ranks, where each micro-batch's loss runs alone, and ``chunks`` times in
one process, where the caller's loss runs once over the whole gathered batch
(``loss_grad_bytes``). A model that computes its own loss has it among its layers: only its
output is added. On ranks every other stage keeps its output too, per micro-batch in flight
(torch's stage keeps it for the backward the received gradient starts; in one process the next
stage's input is that tensor, counted there): ``kept_bytes``, the bytes crossing the stage's
last cut. ``StageCost.loss_bytes`` is the sum, kept apart from ``activation_bytes`` (what
executor.ActivationMeter counts) and inside ``memory_bytes``; measured against live tensor
bytes in docs/benchmarks.md ("Whole-step memory").

[Note: the optimizer step's memory] ``optimizer.step()`` runs after the backward has freed the
activations, with temporaries of its own: Adam and AdamW hold ``exp_avg_sq.sqrt()`` and its
quotient while they step a tensor. torch steps one tensor at a time on the CPU (two copies of the
largest: at most twice the stage's largest layer's parameters) and all of a device's tensors at
once elsewhere (its foreach path: one copy of them all); SGD, with momentum or without, updates
in place. A stage's peak is its state plus the larger of its activations (with the loss's
bytes) and this (``step_bytes``); under FSDP each replica steps its shard. A rank of several
stages (ZB-V) steps them in one optimizer: one tensor at a time it holds the largest stage's
temporaries, all at once every stage's (``backward_memory.step_peak``).

[Note: receive buffers] On ranks torch's PipelineStage receives into buffers it allocates at
the first step and keeps: one per micro-batch for the stage's input (but on the first stage)
and one per micro-batch for its output's gradient (but on the last), ``chunks x (input +
output)`` bytes held through the whole step, optimizer step included (``receive_bytes``). A
micro-batch's input is its buffer, so the walk holds none of it, and of its saves not what the
first layer saves of that input (``received_walk``: input 0, saved less input_saved); a split
backward's received output gradient, kept from I to W, is its buffer too (``weight_held_bytes``'
``buffered``). A backward's input gradient is sent while the stage goes on, and torch lets it go
when the next backward's send is posted: one input's bytes beside everything after the first
backward (``backward_extras``' ``sending``). Between two stages of one rank (ZB-V's middle
pair) the output is handed over in place: the receiving stage's buffer of each micro-batch is
the sender's latest output for it, and the gradient comes back the same way, so the sender
keeps no output of its own beside them and the receiver sends nothing (cost.py). In one process
a stage's input is the previous stage's output, and nothing is received.

[Note: the backward's memory] is in autopipe/core/backward_memory.py: the walk's e (``BEFORE_BACKWARD``
... ``IN_BACKWARD``) marks what each allocation happens beside.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from autopipe.core.layer_costs import LayerCosts
from autopipe.core.schedules import Op, rank_order, stage_order
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    V_SCHEDULES,
    is_recomputed,
    stage_rank,
)

__all__ = ["BEFORE_BACKWARD", "FIRST_BACKWARD", "GRADIENTS", "IN_BACKWARD", "STEP_TEMPORARIES", "Amount", "Extras",
           "Terms", "activation_bytes", "activation_peak", "activation_terms", "gather_peak", "kept_activation_bytes",
           "kept_bytes", "loss_bytes", "loss_grad_bytes", "receive_bytes", "received_walk", "stage_terms", "step_bytes",
           "weight_held_bytes"]

Amount = Any  # a number, a numpy array or a PuLP expression, as in autopipe.core.cost
# (a, b, c, d, e): a x input + b x saved + c x weight_held - d x input_saved bytes, plus the
# backward's extra number e ([Note: the backward's memory]: BEFORE_BACKWARD ... IN_BACKWARD)
Term = tuple[int, int, int, int, int]
Terms = tuple[Term, ...]
Extras = tuple[Amount, Amount, Amount, Amount]

# [Note: the backward's memory]: what an allocation of a stage's walk happens beside
BEFORE_BACKWARD, FIRST_BACKWARD, GRADIENTS, IN_BACKWARD = range(4)
# e >= f in this order: BEFORE <= FIRST <= IN, BEFORE <= GRADIENTS <= IN
_AT_LEAST = {(e, f) for e in range(4) for f in range(4)
             if e == f or f == BEFORE_BACKWARD or e == IN_BACKWARD}


def weight_held_bytes(weight_grad: Amount, output_bytes: Amount, first: bool, last: bool,
                      buffered: bool = False) -> Amount:
    """What one micro-batch of a stage holds from its I to its W besides its activations
    ([Note: stage memory]): the gradients its layers' weight passes start from (the profile's
    ``weight_grad_bytes``; none on the first stage, whose I computes nothing), and, but on the
    last stage, the output gradient it received, which torch's PipelineStage keeps for W, unless
    it is in a receive buffer charged apart (``buffered``, [Note: receive buffers])."""
    return (0 if first else weight_grad) + (0 if last or buffered else output_bytes)


def receive_bytes(costs: LayerCosts, cut_in: Amount, cut_out: Amount, chunks: int) -> Amount:
    """The receive buffers a stage holds through the step ([Note: receive buffers]): on ranks one
    per micro-batch for its input (``cut_in``, 0 on the first stage) and one for its output's
    gradient (``cut_out``, 0 on the last); none in one process."""
    return chunks * (cut_in + cut_out) if costs.runtime == "distributed" else 0


def received_walk(received: bool, input_bytes: Amount, saved_bytes: Amount,
                  input_saved: Amount) -> tuple[Amount, Amount, Amount]:
    """The (input, saved, input_saved) bytes the walk holds per micro-batch: where the input is
    ``received`` into a buffer charged apart, none of it and none of the first layer's save of it
    ([Note: receive buffers])."""
    return (0, saved_bytes - input_saved, 0) if received else (input_bytes, saved_bytes, input_saved)


Held = tuple[int, int, int, int, int, bool, int]


def _held(ops: Iterable[Op], recomputed: Mapping[int, int]) -> Iterator[Held]:
    """(stage, inputs held, saved activations held, weight gradients held, micro-batches
    recomputed and held, after an allocation?, what it is beside: ``BEFORE_BACKWARD`` ...
    ``IN_BACKWARD``) after each change of what a stage holds, walking ``ops`` in order ([Note:
    stage memory], [Note: the backward's memory]); stage s checkpoints its last
    ``recomputed[s]`` micro-batches ([Note: which micro-batches recompute] in executor/spec.py).
    A backward (whole, I or W) is an allocation at its start, with its micro-batch still held."""
    ops = list(ops)
    chunks: dict[int, int] = {}
    for s, _, i in ops:
        chunks[s] = max(chunks.get(s, 0), i + 1)
    held: dict[int, list[int]] = {}
    graded: set[int] = set()  # the stages whose parameters have gradients
    for s, kind, i in ops:
        h = held.setdefault(s, [0, 0, 0, 0])
        checkpointed = is_recomputed(i, chunks[s], recomputed[s])
        backward = IN_BACKWARD if s in graded else FIRST_BACKWARD
        if kind == "F":
            h[0 if checkpointed else 1] += 1
            yield s, h[0], h[1], h[2], h[3], True, GRADIENTS if s in graded else BEFORE_BACKWARD
        elif kind == "I":  # the recomputed forward next to its input, then what W starts from
            h[1] += 1 if checkpointed else 0
            h[2] += 1
            h[3] += 1 if checkpointed else 0
            yield s, h[0], h[1], h[2], h[3], True, backward
        else:
            if kind != "W" and checkpointed:  # the recomputed forward, next to its input
                h[1] += 1
                h[3] += 1  # [Note: an input kept once]
            yield s, h[0], h[1], h[2], h[3], True, backward
            graded.add(s)  # a whole backward or a W leaves its weights' gradients
            h[0] -= 1 if checkpointed else 0
            h[1] -= 1
            h[2] -= 1 if kind == "W" else 0
            h[3] -= 1 if checkpointed else 0
            yield s, h[0], h[1], h[2], h[3], False, GRADIENTS


@lru_cache(maxsize=4096)
def _terms(ops: tuple[Op, ...], recomputed: int) -> Terms:
    stage = ops[0][0] if ops else 0
    seen = {(a, b, c, d, e) for _, a, b, c, d, alloc, e in _held(ops, {stage: recomputed}) if alloc}
    top = [t for t in seen if not any(u != t and _covers(u, t) for u in seen)]
    return tuple(sorted(top)) or ((0, 0, 0, 0, 0),)


def _covers(u: Term, t: Term) -> bool:
    """Whether term ``u``'s level is at least ``t``'s whatever the bytes. input_saved is part of
    both input and saved, so with input = I' + X and saved = S' + X a level is ``a I' + b S' + c
    held + (a + b - d) X`` over independent non-negative amounts, plus the backward's extra e,
    ordered as ``_AT_LEAST`` says ([Note: the backward's memory])."""
    return (u[0] >= t[0] and u[1] >= t[1] and u[2] >= t[2] and u[0] + u[1] - u[3] >= t[0] + t[1] - t[3]
            and (u[4], t[4]) in _AT_LEAST)


def activation_terms(ops: Sequence[Op], recomputed: int) -> Terms:
    """The Pareto-maximal (a, b, c, d, e) held after an allocation by one stage running ``ops``:
    its peak activations are ``max(a x input + b x saved + c x weight_held - d x input_saved)``
    ([Note: stage memory]), its peak beside the backward's the same plus ``extras[e]`` ([Note:
    the backward's memory])."""
    return _terms(tuple(ops), recomputed)


def activation_bytes(input_bytes: Amount, saved_bytes: Amount, terms: Terms, weight_held: Amount = 0,
                     input_saved: Amount = 0, extras: Extras | None = None) -> Amount:
    """Peak activation bytes of a stage: the largest ``a x input + b x saved + c x weight_held -
    d x input_saved`` over its ``terms``, plus ``extras[e]`` where given (:func:`backward_extras`).
    Floats and numpy arrays take the maximum; a PuLP expression needs one term at a time (a
    constraint per term)."""
    out: Amount = None
    for a, b, c, d, e in terms:
        value = b * saved_bytes + a * input_bytes  # a new value, whatever the operands
        if c:
            value = value + c * weight_held
        if d:
            value = value - d * input_saved
        if extras is not None:
            value = value + extras[e]
        if out is None:
            out = value
        elif isinstance(out, np.ndarray) and isinstance(value, np.ndarray) and out.shape == value.shape:
            np.maximum(out, value, out=out)
        else:
            out = np.maximum(out, value)
    return out


def kept_activation_bytes(input_bytes: Amount, saved_bytes: Amount, terms: Terms, weight_held: Amount,
                          input_saved: Amount, kept: Amount, grads: Amount, extras: Extras | None = None) -> Amount:
    """Peak activations of a stage that also keeps ``kept`` bytes per micro-batch in flight, the
    micro-batches a term holds (``a + b - d``: a recomputed one is counted in a and b and once in
    d), with the last stage's loss ``grads`` on top ([Note: the loss's memory]), and the
    backward's ``extras`` ([Note: the backward's memory])."""
    return activation_bytes(input_bytes + kept, saved_bytes + kept, terms, weight_held, input_saved + kept,
                            extras) + grads


def loss_bytes(input_bytes: Amount, saved_bytes: Amount, terms: Terms, weight_held: Amount, input_saved: Amount,
               kept: Amount, grads: Amount) -> Amount:
    """What a stage's kept outputs (and the last stage's loss) add to its peak activations:
    :func:`kept_activation_bytes` less :func:`activation_bytes` ([Note: the loss's memory])."""
    return (kept_activation_bytes(input_bytes, saved_bytes, terms, weight_held, input_saved, kept, grads)
            - activation_bytes(input_bytes, saved_bytes, terms, weight_held, input_saved))


STEP_TEMPORARIES = ("adam", "adamw")  # the optimizers whose step allocates: [Note: the optimizer step's memory]


def step_bytes(param_bytes: Amount, largest_bytes: Amount, optimizer: str, one_at_a_time: bool,
               data_parallel: int = 1, dp_mode: str = "ddp") -> Amount:
    """What ``optimizer.step()`` holds besides the stage's state ([Note: the optimizer step's
    memory]): ``param_bytes`` are the stage's, ``largest_bytes`` its largest layer's."""
    if optimizer not in STEP_TEMPORARIES:
        return 0
    amount = 2 * largest_bytes if one_at_a_time else param_bytes
    return amount / data_parallel if dp_mode == "fsdp" and data_parallel > 1 else amount


def kept_bytes(costs: LayerCosts, output_bytes: Amount, last: Amount, received: Amount = 0) -> Amount:
    """Per micro-batch in flight, what a stage keeps besides its layers' saves ([Note: the loss's
    memory]): the last stage (``last`` true) its model output and its loss's saves; on ranks
    any other its ``output_bytes``, the bytes crossing its last cut. On ranks the last stage
    receives what its earlier stages' layers return (``received``: ``returned_before`` its first
    layer) into its receive buffers ([Note: receive buffers]), not kept again. ``last`` and
    ``received`` may be arrays."""
    ranks = costs.runtime == "distributed"
    other = output_bytes if ranks else 0
    mine = costs.loss_kept - received if ranks else costs.loss_kept
    return np.where(last, mine, other) if isinstance(last, np.ndarray) else (mine if last else other)


def loss_grad_bytes(costs: LayerCosts, chunks: int) -> int:
    """The loss's backward's gradients on the last stage ([Note: the loss's memory]): one
    micro-batch's on ranks, the whole batch's in one process."""
    return costs.loss_grads * (chunks if costs.runtime == "gpipe" else 1)


def _levels(ops: list[Op], recomputed: Mapping[int, int], input_bytes: Mapping[int, float],
            saved_bytes: Mapping[int, float], weight_held: Mapping[int, float] | None,
            input_saved: Mapping[int, float] | None,
            extras: Mapping[int, Extras] | None) -> Iterator[tuple[int, float, bool, int, int]]:
    """(stage, the device's level, after an allocation?, e, micro-batches the stage holds) after
    each change of what a device running ``ops`` holds."""
    level = {s: float(extras[s][BEFORE_BACKWARD]) for s, _, _ in ops} if extras else {}
    for s, a, b, c, d, alloc, e in _held(ops, recomputed):
        level[s] = (a * input_bytes[s] + b * saved_bytes[s] + (c * weight_held[s] if c and weight_held else 0.0)
                    - (d * input_saved[s] if d and input_saved else 0.0)
                    + (float(extras[s][e]) if extras else 0.0))
        yield s, sum(level.values()), alloc, e, a + b - d


def activation_peak(ops: Iterable[Op], recomputed: Mapping[int, int], input_bytes: Mapping[int, float],
                    saved_bytes: Mapping[int, float], weight_held: Mapping[int, float] | None = None,
                    input_saved: Mapping[int, float] | None = None,
                    extras: Mapping[int, Extras] | None = None) -> float:
    """Peak activation bytes of a device running ``ops`` of one or more stages in that order
    (a rank of a multi-stage schedule holds several stages at once), with each stage's
    backward ``extras`` where given ([Note: the backward's memory])."""
    levels = _levels(list(ops), recomputed, input_bytes, saved_bytes, weight_held, input_saved, extras)
    return max((level for _, level, alloc, _, _ in levels if alloc), default=0.0)


def gather_peak(ops: Iterable[Op], recomputed: Mapping[int, int], input_bytes: Mapping[int, float],
                saved_bytes: Mapping[int, float], weight_held: Mapping[int, float] | None,
                input_saved: Mapping[int, float] | None, extras: Mapping[int, Extras] | None,
                gathered: Mapping[int, tuple[float, float]]) -> float:
    """The device's level when executor.GPipe gathers a stage's outputs, just after its last
    forward: the walk's, its outputs per micro-batch held and their copy (``gathered[s]``:
    (per micro-batch, copy)); -inf where no stage gathers ([Note: the backward's memory])."""
    ops = list(ops)
    if not any(gathered.get(s, (0.0, 0.0))[1] for s in {op[0] for op in ops}):
        return -math.inf
    forwards = Counter(s for s, kind, _ in ops if kind == "F")
    out = -math.inf
    for s, level, alloc, e, held in _levels(ops, recomputed, input_bytes, saved_bytes, weight_held, input_saved,
                                            extras):
        if alloc and e in (BEFORE_BACKWARD, GRADIENTS):  # a forward
            forwards[s] -= 1
            if forwards[s] == 0 and gathered.get(s, (0.0, 0.0))[1]:
                out = max(out, level + held * gathered[s][0] + gathered[s][1])
    return out


def _stage_ops(schedule: str, stage: int, stages: int, chunks: int, ranks: int | None, merge: str) -> list[Op]:
    if schedule in MULTI_STAGE_SCHEDULES:
        w = ranks if ranks is not None else stages // 2 if schedule in V_SCHEDULES else stages
        rank = stage_rank(schedule, stage, w)
        return [op for op in rank_order(schedule, rank, w, chunks, stages // w, merge) if op[0] == stage]
    return stage_order(schedule, stage, stages, chunks)


@lru_cache(maxsize=65536)
def stage_terms(schedule: str, stage: int, stages: int, chunks: int, recomputed: int,
                ranks: int | None = None, merge: str = "unwaited") -> Terms:
    """``activation_terms`` of stage ``stage`` of ``stages`` under ``schedule`` with ``chunks``
    micro-batches; a schedule of several stages per rank needs the number of ``ranks`` (default:
    one stage per rank, or two under the V schedules); ``merge``: the zero-bubble schedules'
    merge rule ([Note: adjacent I and W] in executor/spec.py)."""
    return activation_terms(_stage_ops(schedule, stage, stages, chunks, ranks, merge), recomputed)

