"""The cost model: a stage's time and memory from a Profile, for any layer -> stage assignment.

Everything the partitioners optimise and the Plan reports is computed here, so the DP, the ILP,
the baselines and ``Plan.from_stages`` agree to the last byte.

[Note: stage time] A stage's time is its average work per micro-batch: forward + backward +
recompute (a second forward, for the micro-batches that are checkpointed, times the measured
``recompute_ratio``) divided by the device's relative speed, plus the fixed cost of one stage
call and the transfers it sends (see [Note: measured overheads], [Note: transfer cost]). ``M x stage time`` is
the stage's busy time per iteration; the slowest stage (the bottleneck) sets the pipeline's pace.

[Note: measured overheads] Two things the per-layer profile leaves out, measured by the profiler
(autopipe/frontend/profiling/corrections/overheads.py) and kept in the profile's metadata; a profile without them
(older ones, synthetic ones) gets today's model: no fixed cost and a ratio of 1.
- ``stage_call_fwd_ms`` / ``stage_call_bwd_ms``: the fixed cost of running ONE micro-batch
  through ONE stage module, forward and backward, whatever its layers (the module's call, the
  runtime's per-task bookkeeping, the autograd engine's per-stage work, the micro-batch split
  and join spread over the calls). It is host time, so it is added to a stage's time as is,
  not divided by the device's ``speed``; every stage pays it once per micro-batch. A ``--comm``
  profile also has the distributed runtime's under 1F1B (``stage_call_1f1b_*``), which 1F1B
  and interleaved 1F1B plans pay instead (``LayerCosts.call_for``).
- ``recompute_ratio``: what recomputing a checkpointed micro-batch really costs, as a multiple
  of the layers' profiled forward. Recomputation is not one extra forward: the checkpointed
  forward itself runs without autograd (cheaper), the recompute runs with it, and the
  checkpoint saves and restores RNG state. ``recompute_ms`` scales by it.
- ``recompute_call_ms``: the checkpoint's own fixed host cost per stage and recomputed
  micro-batch (its autograd nodes, the RNG state saved and restored, the nested backward),
  whatever the stage's layers: on a CPU about as much as a small stage's forward, so it is
  not negligible where stages are small (measured: docs/benchmarks.md, "Measured vs predicted,
  one process").
  ``recompute_ms(..., fixed_ms=)`` adds it per stage; a per-layer sum never carries it, so the
  DPs add it with the call cost (``stage_fixed_ms``).

[Note: transfer cost] is in autopipe/core/transfer.py.

[Note: stage memory] (autopipe/core/stage_memory.py) A stage's memory is its parameters x
optimizer factor (``none`` 1 = weights only, ``sgd`` 2 = +grads, ``momentum`` 3,
``adam``/``adamw`` 4) + buffers + its activations, walked over its schedule's order there.

[Note: split backward time] Under the zero-bubble schedules ([Note: split backward] in
autopipe/core/zero_bubble.py) a stage's backward of one micro-batch is its input-gradient part I,
the sum of its layers' ``bwd_input_ms`` (their share of ``bwd_ms``, however the profile's rows
were scaled), and its weight-gradient part W, the rest, each times the profile's
``bwd_split_ratio``: the two halves cost more than the whole backward (two passes of autograd's
engine, and a weight pass of its own per group of weights), and the runtime pays it (measured:
docs/benchmarks.md, "Split backward per stage" and "Zero bubble on two ranks"; the profiles'
ratios: docs/limitations.md, "Zero-bubble schedules").
Two stages do not split, as executor/ranks/split_backward.py runs them: the first stage's I is nothing
and its W the whole backward, and a stage holding a segment of recomputed layers (torch's
reentrant checkpoint) runs its whole backward, with the recomputation, at the I and holds
nothing for a W (``split_parts``). The stage call's backward cost is paid half by each (``split_backward_ms``:
two calls where there was one; [Note: zero-bubble calls] in corrections.py). A profile
without the split (measured before it, or written by hand) plans every other schedule and
refuses these in one line (``check_split``).

Replicas of the pipeline (``data_parallel``) change a stage's state bytes and add its
collectives (per iteration, not per micro-batch): autopipe/core/data_parallel.py, [Note: pipeline x
data parallel].

[Note: mixed precision memory] Under ``precision="bf16"`` / ``"fp16"`` (executor/precision.py's
[Note: mixed precision]) a stage keeps fp32 master parameters, fp32 gradients and fp32 optimizer
state: ``state_bytes`` as in fp32, from the profile's fp32 ``param_bytes``. Its activations are
what the profile measured under autocast (autopipe/frontend/profiling/harness/under_autocast.py): low-dtype
values, and the low-dtype copies of weights that autocast casts for a matmul and autograd saves
for its backward, one copy per micro-batch (each stage call is its own autocast region, whose
cast cache is emptied when the call returns). All of that is in ``saved_bytes`` and the cut
bytes, so the activation formula is unchanged. What the measurement does not see is the cast
cache while a checkpointed forward runs: without autograd nothing is saved, but the cache
still holds a low-dtype copy of every weight the stage has cast until the call returns. That
is ``cast_cache_bytes``: at most the stage's parameters in the compute dtype, charged to a
stage that recomputes any micro-batch, on top of its state (an upper bound: parameters autocast
never casts, a LayerNorm's, an embedding's, count too). Under ``never`` the cached copies are the
saved ones, already counted. A profile without ``meta["precision"]`` is fp32: no cache.

[Note: the loss's memory] and [Note: the optimizer step's memory] are in
autopipe/core/stage_memory.py.

[Note: tied parameters] Layers with the same ``tie_group`` share a parameter whose bytes are the
largest ``param_bytes`` in the group. ``ties="share"`` charges them to every stage that holds a
member (the executor shares or replicates them); ``ties="colocate"`` forces the whole group onto
one stage. In one process (executor.GPipe) stages on the same device share one tensor, and so
do the stages a rank of a multi-stage schedule holds (its device name is the rank): the group
is charged to the first of them only; other ranks are processes of their own, each holding its
copy whatever their devices are called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autopipe.core.backward_memory import backward_extras, stage_backward
from autopipe.core.data_parallel import grad_sync_ms, param_gather_ms, state_factor
from autopipe.core.devices import DeviceSpec, resolve_devices
from autopipe.core.layer_costs import SPLIT_COLUMNS, FloatArray, LayerCosts
from autopipe.core.recomputed_layers import (
    recompute_alone_ms,
    recompute_peak,
    recomputed_outputs,
    recomputed_runs,
    segment_freed,
)
from autopipe.core.schedules import rank_layout
from autopipe.core.stage_cost import StageCost
from autopipe.core.stage_memory import (
    STEP_TEMPORARIES,
    Terms,
    activation_bytes,
    activation_peak,
    activation_terms,
    build_bytes,
    gather_peak,
    kept_activation_bytes,
    kept_bytes,
    loss_bytes,
    loss_grad_bytes,
    receive_bytes,
    received_walk,
    stage_terms,
    step_bytes,
    weight_held_bytes,
)
from autopipe.core.transfer import DEFAULT_BANDWIDTH, Amount, crossing_ms, receive_ms, transfer_ms
from autopipe.errors import PartitionError
from executor.spec import MULTI_STAGE_SCHEDULES, PRECISION_BYTES, ZERO_BUBBLE_SCHEDULES

if TYPE_CHECKING:
    from autopipe.core.cost_options import CostOptions

__all__ = [
    "OPTIMIZER_FACTOR",
    "DeviceSpec",
    "LayerCosts",
    "StageCost",
    "layer_work",
    "recompute_ms",
    "stage_fixed_ms",
    "Terms",
    "activation_terms",
    "activation_bytes",
    "activation_peak",
    "backward_extras",
    "gather_peak",
    "STEP_TEMPORARIES",
    "kept_activation_bytes",
    "kept_bytes",
    "loss_bytes",
    "loss_grad_bytes",
    "receive_bytes",
    "received_walk",
    "step_bytes",
    "stage_terms",
    "weight_held_bytes",
    "split_backward_ms",
    "split_parts",
    "check_split",
    "state_bytes",
    "cast_cache_bytes",
    "stage_time",
    "transfer_ms",
    "crossing_ms",
    "receive_ms",
    "DEFAULT_BANDWIDTH",
    "lower_bound",
    "resolve_devices",
    "schedule_ranks",
    "stage_costs",
]

OPTIMIZER_FACTOR: dict[str, int] = {"none": 1, "sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}
# Amount: a number, a numpy array or a PuLP expression: each formula below takes any of them.

# --- [Note: cost model] Every formula of stage time and memory is written once, below (a cut's
# crossing in transfer.py, a recomputed segment of layers in recomputed_layers.py, the walk of a
# stage's activations over its schedule's order in stage_memory.py). ----------------------------
# The DP evaluates them on numpy arrays of whole (first layer, last layer) blocks, the ILP on PuLP
# expressions, stage_costs / Plan / the baselines on floats; each function is plain arithmetic on
# its arguments, so one definition serves all of them. Change a formula here, and only here.


def recompute_ms(fwd: Amount, recomputed: int, chunks: int, ratio: float = 1.0,
                 fixed_ms: float = 0.0) -> Amount:
    """Average recomputation per micro-batch: ``ratio`` x the forward, plus the checkpoint's own
    ``fixed_ms`` (once per stage and recomputed micro-batch: give it for a whole stage, never
    for a layer), for R of the M micro-batches ([Note: measured overheads]; 1 = exactly a
    second forward)."""
    return (fwd * ratio + fixed_ms) * (recomputed / chunks)


def stage_fixed_ms(call_ms: float, recompute_call_ms: float, recomputed: int, chunks: int) -> float:
    """The fixed host cost per micro-batch of a stage recomputing R of M: its call and the
    checkpoint's own work ([Note: measured overheads])."""
    return call_ms + float(recompute_ms(0.0, recomputed, chunks, fixed_ms=recompute_call_ms))


def layer_work(fwd: Amount, bwd: Amount, recomputed: int, chunks: int,
               ratio: float = 1.0) -> Amount:
    """Compute per micro-batch of a layer (or a sum of layers) on the profiled device, in ms:
    forward + backward + recompute ([Note: stage time])."""
    return fwd + recompute_ms(fwd, recomputed, chunks, ratio) + bwd


def stage_time(
    work: Amount, speed: float, input_bytes: Amount, output_bytes: Amount, ms_per_byte: float,
    call_ms: float = 0.0, latency_ms: float = 0.0, receive_share: float = 0.0,
) -> Amount:
    """A stage's time per micro-batch: its work on a device of relative ``speed``, the fixed
    cost of one stage call (host time, not scaled: [Note: measured overheads]), plus the
    transfers at both of its cuts ([Note: stage time], [Note: transfer cost])."""
    return work / speed + call_ms + transfer_ms(input_bytes, output_bytes, ms_per_byte, latency_ms,
                                                receive_share)


def state_bytes(param_bytes: Amount, buffer_bytes: Amount, optimizer: str, data_parallel: int = 1,
                dp_mode: str = "ddp") -> Amount:
    """Parameters with their gradients and optimizer state (``OPTIMIZER_FACTOR``; sharded over
    replicas under ``fsdp``: [Note: pipeline x data parallel]), plus buffers."""
    return param_bytes * state_factor(OPTIMIZER_FACTOR[optimizer], data_parallel, dp_mode) + buffer_bytes


def cast_cache_bytes(param_bytes: Amount, precision: str, recomputed: int) -> Amount:
    """Autocast's cached low-dtype weights that a stage recomputing ``recomputed`` micro-batches
    holds during a checkpointed forward ([Note: mixed precision memory]); 0 in fp32 or without
    recomputation."""
    if precision == "fp32" or recomputed == 0:
        return 0
    return param_bytes * PRECISION_BYTES[precision] / PRECISION_BYTES["fp32"]


def split_parts(input_ms: float, bwd_ms: float, ratio: float, *, first: bool, whole: bool) -> tuple[float, float]:
    """A stage's I and W of one micro-batch ([Note: split backward time]) from its layers'
    input-gradient part ``input_ms`` of its backward ``bwd_ms``: each scaled by ``ratio`` (what
    the two halves take over the whole); on a stage holding a segment of recomputed layers
    (``whole``) all of the backward, whole, at the I; else on the first stage all of it, whole,
    at the W."""
    if whole:
        return bwd_ms, 0.0
    if first:
        return 0.0, bwd_ms
    return input_ms * ratio, (bwd_ms - input_ms) * ratio


def split_backward_ms(bwd_ms: float, bwd_input_ms: float, call_bwd_ms: float,
                      bwd_weight_ms: float | None = None) -> tuple[float, float]:
    """The I and W operations of a split backward ([Note: split backward time]): the stage's
    input-gradient part and its weight-gradient part (default: the rest of its backward), each
    with half its backward call cost."""
    weight = bwd_ms - bwd_input_ms if bwd_weight_ms is None else bwd_weight_ms
    return bwd_input_ms + call_bwd_ms / 2, weight + call_bwd_ms / 2


def check_split(costs: LayerCosts, schedule: str) -> None:
    """PartitionError in one line when ``schedule`` splits each backward and the profile has no
    split of it ([Note: split backward time])."""
    if schedule in ZERO_BUBBLE_SCHEDULES and costs.bwd_input is None:
        raise PartitionError(f"profile again: schedule={schedule!r} splits each backward into input and weight "
                             f"gradients, and this profile has no {'/'.join(SPLIT_COLUMNS)} columns (autopipe "
                             f"profile measures them); or plan schedule='1f1b' or 'interleaved1f1b'")


def lower_bound(work: FloatArray, speeds: Sequence[float], call_ms: float = 0.0) -> float:
    """No split's bottleneck is below max(total work / total speed, largest layer / fastest),
    plus the fixed cost every stage pays per call ([Note: measured overheads])."""
    if len(work) == 0:
        return 0.0
    return max(float(work.sum()) / sum(speeds), float(work.max()) / max(speeds)) + call_ms


def schedule_ranks(schedule: str, devices: Sequence[DeviceSpec]) -> int | None:
    """The ranks a schedule of several stages per rank places its stages on (the distinct device
    names: [Note: stage to rank] in executor/spec.py), else None; PartitionError when the
    devices do not take the stages so."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        return None
    try:
        return rank_layout([d.name for d in devices], schedule)[0]
    except ValueError as err:
        raise PartitionError(str(err)) from None


def _crossings(costs: LayerCosts, stage: np.ndarray, u: int) -> list[tuple[int, int]]:
    """(cut, bytes) for every cut layer u's values cross: the most one consumer beyond it reads."""
    reach = sorted(((int(stage[v]), b) for v, b in costs.reads(u)), reverse=True)
    out, level = [], 0
    for s in range(reach[0][0] - 1, int(stage[u]) - 1, -1):
        level = max([level] + [b for t, b in reach if t == s + 1])
        out.append((s, level))
    return out


def stage_costs(
    costs: LayerCosts,
    assignment: Sequence[int],
    devices: Sequence[DeviceSpec],
    options: CostOptions,
) -> list[StageCost]:
    """Cost of every stage when layer i runs on stage ``assignment[i]`` (0-based)."""
    k = len(devices)
    stage = np.asarray(assignment, dtype=np.int64)
    if stage.shape != (len(costs),):
        raise PartitionError(f"assignment has {stage.size} entries for {len(costs)} layers")
    m = options.chunks
    recomputed = options.recomputed(k)
    terms = options.terms(k, schedule_ranks(options.schedule, devices))
    replicas = (options.data_parallel, options.dp_mode, options.ms_per_byte)
    cut = np.zeros(max(k - 1, 0), dtype=np.int64)  # bytes crossing cut s (between s and s+1)
    resaved = np.zeros_like(cut)  # of them, saved on both sides ([Note: saved once])
    for u, users in enumerate(costs.consumers):
        if users:
            for s, nbytes in _crossings(costs, stage, u):  # [Note: what a consumer reads] in layer_costs.py
                cut[s] += nbytes
            if costs.savers[u]:
                resaved[stage[u]:int(stage[list(costs.savers[u])].max())] += costs.resaved[u]
    call_fwd, call_bwd = costs.call_for(options.schedule)
    check_split(costs, options.schedule)
    split, ranks_runtime = options.schedule in ZERO_BUBBLE_SCHEDULES, costs.runtime == "distributed"
    multi = ranks_runtime and options.schedule in MULTI_STAGE_SCHEDULES
    chosen, runs = recomputed_runs(costs, stage, options.modes(k), options.recompute_layers,  # [Note: recomputed layers]
                                   options.segment_starts)
    result = []
    for s, dev in enumerate(devices):
        mask = stage == s
        mine = [r for r in runs if stage[r[0]] == s]
        fwd = float(costs.fwd[mask].sum()) / dev.speed
        alone = recompute_alone_ms(sum(float(costs.fwd[r].sum()) for r in mine), len(mine),
                                   costs.recompute_ratio, costs.recompute_call_ms, dev.speed)
        bwd = float(costs.bwd[mask].sum()) / dev.speed + alone
        params, buffers = int(costs.params[mask].sum()), int(costs.buffers[mask].sum())
        one_holder = costs.runtime == "gpipe" or options.schedule in MULTI_STAGE_SCHEDULES  # a device, a rank
        for members, nbytes in costs.tie_groups:  # [Note: tied parameters]
            shared = one_holder and any(  # held by an earlier stage on this device
                devices[t].name == dev.name and (stage[list(members)] == t).any() for t in range(s))
            if mask[list(members)].any() and not shared:
                params += nbytes
        saved = int(costs.saved[mask].sum()) - sum(segment_freed(costs, r) for r in mine) + (
            int(resaved[s - 1]) if s > 0 else 0)
        cut_in = int(cut[s - 1]) if s > 0 else 0
        first = int(np.flatnonzero(mask)[0]) if mask.any() else 0  # [Note: an input kept once]
        input_saved = min(int(costs.saved_input[first]), cut_in, saved) if s > 0 and first > 0 else 0
        cut_out = int(cut[s]) if s < k - 1 else 0
        bwd_input, bwd_weight, held, loss = None, None, 0, 0
        if costs.bwd_input is not None and costs.weight_grad is not None and split:
            bwd_input, bwd_weight = split_parts(float(costs.bwd_input[mask].sum()) / dev.speed, bwd, costs.split_ratio,
                                                first=s == 0, whole=bool(mine))
            held = 0 if mine else int(weight_held_bytes(int(costs.weight_grad[mask].sum()), cut_out, s == 0,
                                                        s == k - 1, ranks_runtime))
        largest = int(costs.layer_params[mask].max()) if costs.layer_params is not None and mask.any() else 0
        step = int(step_bytes(params, largest, options.optimizer, costs.one_at_a_time, *replicas[:2]))
        # [Note: receive buffers] in stage_memory.py: between two stages of one rank, in place
        beside = [multi and 0 <= t < k and devices[t].name == dev.name for t in (s - 1, s + 1)]
        kept = 0 if beside[1] else kept_bytes(costs, cut_out, s == k - 1, costs.received_before(first))
        grads = loss_grad_bytes(costs, m) if s == k - 1 else 0  # the input gradient sent: beside the working sets
        sending = cut_in * (ranks_runtime and not beside[0] and costs.working is not None)
        again, outputs = recompute_peak(costs, mine, np.flatnonzero(mask & ~chosen).tolist())  # [Note: recomputed layers]
        walk = received_walk(ranks_runtime, cut_in, saved, input_saved)
        if kept or grads:  # [Note: the loss's memory]
            loss = int(loss_bytes(walk[0], walk[1], terms[s], held, walk[2], kept, grads))
        lazy, first, working, gathered, backward = stage_backward(  # [Note: the backward's memory]
            costs, mask, params, OPTIMIZER_FACTOR[options.optimizer], options, s == k - 1, terms[s],
            (walk[0], walk[1], held, walk[2], kept, grads), sending)
        result.append(StageCost(
            fwd_ms=fwd, bwd_ms=bwd, recompute_ms=recompute_ms(fwd, recomputed[s], m, costs.recompute_ratio,
                                                              costs.recompute_call_ms),
            transfer_ms=transfer_ms(cut_in, cut_out, options.ms_per_byte, costs.comm_latency_ms,
                                    costs.comm_receive_share),
            param_bytes=int(state_bytes(params, buffers, options.optimizer,
                                        options.data_parallel, options.dp_mode)
                            + cast_cache_bytes(params, costs.precision, recomputed[s])),
            build_bytes=int(build_bytes(params, buffers)),  # [Note: the build's memory] in stage_memory.py
            activation_bytes=int(activation_bytes(walk[0], walk[1], terms[s], held, walk[2])) + again,
            input_bytes=cut_in, output_bytes=cut_out, saved_bytes=saved,
            call_fwd_ms=call_fwd, call_bwd_ms=call_bwd,
            recompute_ratio=costs.recompute_ratio, recompute_call_ms=costs.recompute_call_ms,
            latency_ms=costs.comm_latency_ms if options.ms_per_byte else 0.0,
            receive_share=costs.comm_receive_share if options.ms_per_byte else 0.0,
            grad_sync_ms=grad_sync_ms(params, *replicas),
            param_gather_ms=param_gather_ms(params, *replicas),
            bwd_input_ms=bwd_input,
            weight_held_bytes=held, input_saved_bytes=input_saved, bwd_weight_ms=bwd_weight,
            loss_bytes=loss,
            step_bytes=step,
            lazy_grad_bytes=lazy,
            first_backward_bytes=first,
            working_bytes=working,
            gathered_bytes=gathered,
            backward_bytes=backward,
            receive_bytes=int(receive_bytes(costs, cut_in, cut_out, m)), kept_bytes=int(kept), loss_grad_bytes=int(grads),
            sending_bytes=sending, one_at_a_time=costs.one_at_a_time, recompute_bytes=again,
            recompute_outputs_bytes=outputs + recomputed_outputs(cut_out, s == k - 1, recomputed[s]),
            recompute_segments=len(mine)))
    return result
