"""Event simulation of a pipeline schedule: per-stage timeline, iteration time, peak memory.

Each device runs one operation at a time, in the order its schedule fixes ([Note: schedule
orders] in autopipe/core/schedules.py, torch.distributed.pipelining's own orders):

    gpipe            F0 F1 ... F(M-1)  B0 B1 ... B(M-1)             (ScheduleGPipe)
    1f1b             min(M, K-s) warm-up forwards, then one backward / one forward, then the rest
    interleaved1f1b  V stages per rank, stage s on rank s % W, torch's interleaved order
    interleaved_zb   the same layout, ZB1P's order of forwards, input and weight gradients
    zbv, dualpipev   two stages per rank in a V (rank r: r and 2W-1-r), torch's orders

A forward of micro-batch m on stage s waits for stage s-1's forward of m and its transfer; a
backward (or, split, its input-gradient part I: [Note: split backward] in
autopipe/core/zero_bubble.py) waits for stage s+1's backward or I of m and the gradient's
transfer; a weight-gradient part W for its own stage's I of m. Two consecutive stages on one
rank (the V's bottom) pass values without a message, as torch's runtime does, so nothing
crosses there. A checkpointed
micro-batch (see [Note: stage memory] in autopipe.core.stage_memory) is recomputed right before its
backward, once the gradient has arrived. After a forward the stage sends its output activations,
after a backward its input gradients; sends occupy the sender, and receiving occupies the
receiver for its share of the bytes right before the forward or backward that reads them
([Note: transfer cost]).

Replicas ([Note: pipeline x data parallel] in autopipe/core/data_parallel.py): a stage with a
``param_gather_ms`` all-gathers its parameters right before its first forward, on its device;
its ``grad_sync_ms`` collective (all-reduce, or reduce-scatter after a gather) starts when its
last backward's compute ends (its last W under the zero-bubble schedules: [Note: weight
gradients and the all-reduce] in autopipe/core/data_parallel.py), on the device's communication stream (one collective at a time
per device), while the device computes on. The iteration ends with the last event of any kind;
collectives are not busy time in the bubble.

Memory: a stage holds its parameter state throughout, and its activations as the cost model's
walk over the operations its device ran, in the order it ran them (``cost.activation_peak``), so
the peaks are the cost model's, exactly ([Note: stage memory] in autopipe/core/stage_memory.py). ``device_memory`` is each device's peak with all of its
stages together (an interleaved rank's stages, or stages sharing one device).

The events are executor.spec.TimelineEvent, the value the executor measures, so a predicted and a
measured timeline can be drawn on one plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from autopipe.core.backward_memory import step_peak, walk_maps
from autopipe.core.cost import (
    LayerCosts,
    StageCost,
    activation_peak,
    crossing_ms,
    gather_peak,
    receive_ms,
    recompute_ms,
    split_backward_ms,
    stage_costs,
)
from autopipe.core.data_parallel import sync_phase
from autopipe.core.schedules import Op, rank_layout, rank_order, stage_order
from autopipe.errors import PartitionError, PlanError
from executor.spec import (
    DATA_PARALLEL_PHASES,
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    TimelineEvent,
    check_merge_rule,
    check_stage_recompute,
    is_recomputed,
    recomputed_microbatches,
)

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.core.profile_table import Profile

__all__ = ["SIMULATED_SCHEDULES", "SimulationResult", "operation_queues", "simulate", "simulate_stages"]

# The runtime's schedules (executor.spec.SCHEDULES): the simulator models every one of them.
SIMULATED_SCHEDULES: tuple[str, ...] = SCHEDULES


@dataclass(frozen=True)
class SimulationResult:
    schedule: str
    timeline: list[TimelineEvent]
    iteration_time: float  # ms
    bubble_fraction: float  # idle share of devices x iteration_time
    peak_memory: list[int]  # bytes per stage
    device_memory: dict[str, int] = field(default_factory=dict)  # peak bytes per device

    def summary(self) -> str:
        """A few lines: iteration time, bubble and each stage's busy time and peak memory."""
        from autopipe.core.units import format_bytes

        k = len(self.peak_memory)
        lines = [f"schedule {self.schedule}: iteration {self.iteration_time:.3f} ms, "
                 f"bubble {100 * self.bubble_fraction:.1f}% over {k} stages"]
        for s in range(k):
            events = [e for e in self.timeline if e.stage == s and e.phase not in DATA_PARALLEL_PHASES]
            busy = sum(e.end_ms - e.start_ms for e in events)
            first = min((e.start_ms for e in events), default=0.0)
            last = max((e.end_ms for e in events), default=0.0)
            comm = "".join(f", {e.phase} {e.start_ms:.3f} .. {e.end_ms:.3f} ms" for e in self.timeline
                           if e.stage == s and e.phase in DATA_PARALLEL_PHASES)
            lines.append(f"  stage {s}: busy {busy:.3f} ms from {first:.3f} to {last:.3f} ms{comm}, "
                         f"peak memory {format_bytes(self.peak_memory[s])}")
        return "\n".join(lines)


def _clock(op: Op, k: int, m: int) -> tuple[int, int]:
    """Fill-drain priority of an operation among stages that share a device: backwards first
    (they free memory), each wave in clock-cycle order (micro-batch + distance travelled)."""
    s, kind, i = op
    return (i + s, s) if kind == "F" else (i + (k - 1 - s) - 2 * (k + m), -s)


def _split(stage: StageCost, schedule: str) -> tuple[float, float]:
    """The I and W operations' durations of a split backward ([Note: split backward time] in
    autopipe/core/cost.py); PlanError when the stage's profile had no split."""
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        return 0.0, 0.0
    if stage.bwd_input_ms is None:
        raise PlanError(f"profile again: schedule={schedule!r} splits each backward into input and weight "
                        "gradients and these stage costs have no split (bwd_input_ms); simulate(plan, profile, "
                        "schedule=...) with a profile that has it, or another schedule")
    return split_backward_ms(stage.bwd_ms, stage.bwd_input_ms, stage.call_bwd_ms, stage.bwd_weight_ms)


def operation_queues(schedule: str, names: list[str], m: int,
                     merge: str) -> tuple[list[list[Op]], list[int], list[int]]:
    """The operation queues, the device (resource) each runs on, and each stage's device (also
    the step's batch of splits: [Note: steps in a batch] in autopipe/solvers/split_steps.py)."""
    k = len(names)
    if schedule in MULTI_STAGE_SCHEDULES:
        try:
            w, rank_of = rank_layout(names, schedule)
        except ValueError as err:
            raise PlanError(str(err)) from None
        return [rank_order(schedule, r, w, m, k // w, merge) for r in range(w)], list(range(w)), rank_of
    device = [names.index(n) for n in names]
    return [stage_order(schedule, s, k, m) for s in range(k)], device, device


def simulate_stages(
    stages: Sequence[StageCost],
    *,
    chunks: int,
    recompute: str | Sequence[str],
    ms_per_byte: float,
    schedule: str = "gpipe",
    devices: Sequence[str] | None = None,
    merge: str = "unwaited",
) -> SimulationResult:
    """Simulate one training iteration of stages with the given per-micro-batch costs.

    ``recompute`` is one mode or one per stage. ``devices`` names each stage's device; stages
    with the same name share it and never run at the same time (see [Note: shared devices]);
    under a schedule of several stages per rank the names are the ranks, as
    ``executor.spec.stage_rank`` places the stages. Default: every stage on its own device.
    ``merge``: which adjacent I and W of a zero-bubble schedule run as one backward
    ([Note: adjacent I and W] in executor/spec.py).
    """
    if schedule not in SIMULATED_SCHEDULES:
        raise PlanError(f"schedule={schedule!r} is not simulated; choose one of {list(SIMULATED_SCHEDULES)}")
    k, m = len(stages), chunks
    names = list(devices) if devices is not None else [f"stage{s}" for s in range(k)]
    if len(names) != k:
        raise PlanError(f"{len(names)} devices for {k} stages: give one device per stage")
    try:
        rec = [recomputed_microbatches(mode, m) for mode in check_stage_recompute(recompute, k)]
    except ValueError as err:
        raise PlanError(str(err)) from None
    try:
        check_merge_rule(merge)
    except ValueError as err:
        raise PlanError(str(err)) from None
    queues, resource, device_of = operation_queues(schedule, names, m, merge)
    n_res = max(resource) + 1
    # a cut between two stages of one rank carries no message ([Note: stage to rank])
    local = [schedule in MULTI_STAGE_SCHEDULES and device_of[s] == device_of[s + 1] for s in range(k - 1)]
    parts = [_split(st, schedule) for st in stages]
    ready: dict[tuple[str, int, int], float] = {("F", 0, i): 0.0 for i in range(m)}
    pos, free = [0] * len(queues), [0.0] * n_res
    comm_free = [0.0] * n_res  # each device's collectives, one at a time
    forwards, backwards = [0] * k, [0] * k  # done per stage
    ran: list[list[Op]] = [[] for _ in range(n_res)]
    timeline: list[TimelineEvent] = []

    def emit(s: int, i: int, phase: str, start: float, dur: float) -> float:
        if dur > 0 or phase != "transfer":
            timeline.append(TimelineEvent(s, i, phase, start, start + dur))
        return start + dur

    def execute(q: int, start: float) -> None:
        op = queues[q][pos[q]]
        s, kind, i = op
        st = stages[s]
        if kind == "F":
            if s > 0 and not local[s - 1]:  # the receiving end of the crossing ([Note: transfer cost])
                start = emit(s, i, "transfer", start, receive_ms(st.input_bytes, ms_per_byte, st.receive_share))
            if forwards[s] == 0 and st.param_gather_ms > 0:  # fsdp: gathered once, not prefetched
                start = comm_free[resource[q]] = emit(s, i, "allgather", start, st.param_gather_ms)
            forwards[s] += 1
            end = emit(s, i, "forward", start, st.fwd_ms + st.call_fwd_ms)
            if s == k - 1:
                ready["B", s, i] = end
            elif local[s]:
                ready["F", s + 1, i] = end
            else:
                end = ready["F", s + 1, i] = emit(
                    s, i, "transfer", end, crossing_ms(st.output_bytes, ms_per_byte, st.latency_ms))
        elif kind == "W":
            end = emit(s, i, "weight", start, parts[s][1])
            end = synced(s, q, i, end)
        else:  # a whole backward "B", or its input-gradient part "I"
            if s < k - 1 and not local[s]:
                start = emit(s, i, "transfer", start, receive_ms(st.output_bytes, ms_per_byte, st.receive_share))
            if is_recomputed(i, m, rec[s]):
                start = emit(s, i, "recompute", start, recompute_ms(st.fwd_ms, 1, 1, st.recompute_ratio,
                                                                   st.recompute_call_ms))
            end = emit(s, i, "backward", start, parts[s][0] if kind == "I" else st.bwd_ms + st.call_bwd_ms)
            if kind == "I":
                ready["W", s, i] = end
            else:
                end = synced(s, q, i, end)
            if s > 0 and local[s - 1]:
                ready["B", s - 1, i] = end
            elif s > 0:
                end = ready["B", s - 1, i] = emit(
                    s, i, "transfer", end, crossing_ms(st.input_bytes, ms_per_byte, st.latency_ms))
        free[resource[q]] = end
        ran[resource[q]].append(op)
        pos[q] += 1

    def synced(s: int, q: int, i: int, end: float) -> float:
        """After a stage's last gradient (its last B or W), its collective on the comm stream."""
        backwards[s] += 1
        st = stages[s]
        if backwards[s] == m and st.grad_sync_ms > 0:  # after the last backward's compute
            at = max(end, comm_free[resource[q]])
            comm_free[resource[q]] = emit(s, i, sync_phase(st.param_gather_ms), at, st.grad_sync_ms)
        return end

    def start_of(q: int) -> float | None:
        if pos[q] >= len(queues[q]):
            return None
        s, kind, i = queues[q][pos[q]]
        when = ready.get(("B" if kind == "I" else kind, s, i))
        return None if when is None else max(free[resource[q]], when)

    if len(set(resource)) == len(resource):  # one queue per device: each runs its own order
        progress = True
        while progress:
            progress = False
            for q in range(len(queues)):
                while (start := start_of(q)) is not None:
                    execute(q, start)
                    progress = True
    else:
        # [Note: shared devices] List scheduling: repeatedly run the ready operation that can
        # start first (ties in fill-drain clock order, _clock). With one device per stage this
        # gives the same times as running each stage's order independently; stages on one
        # device (executor.GPipe with devices=["cpu", "cpu"]) take turns, as they do there.
        while True:
            candidates = [(start, _clock(queues[q][pos[q]], k, m), q)
                          for q in range(len(queues)) if (start := start_of(q)) is not None]
            if not candidates:
                break
            start, _, q = min(candidates)
            execute(q, start)
    if any(p < len(o) for p, o in zip(pos, queues, strict=True)):  # pragma: no cover - a bug
        raise RuntimeError("schedule deadlocked")
    total = max((e.end_ms for e in timeline), default=0.0)
    busy = sum(e.end_ms - e.start_ms for e in timeline if e.phase not in DATA_PARALLEL_PHASES)
    recomputed = dict(enumerate(rec))
    # each stage's walk: [Note: an input kept once], [Note: receive buffers] and [Note: the optimizer
    # step's memory] in stage_memory.py, [Note: the backward's memory] in backward_memory.py
    maps, loss = walk_maps(stages, recomputed)
    plain, _ = walk_maps(stages, recomputed, kept=False)  # executor.GPipe's gathering adds its own
    # executor.GPipe's gathered outputs: (per micro-batch, their copy) on the last stage
    gathered = {s: (st.gathered_bytes / m, float(st.gathered_bytes)) for s, st in enumerate(stages)}
    peaks = []
    for s, st in enumerate(stages):
        mine = [op for op in ran[device_of[s]] if op[0] == s]
        peaks.append(st.param_bytes + st.receive_bytes + int(max(
            loss[s] + activation_peak(mine, *maps), st.step_bytes, gather_peak(mine, *plain, gathered))))
    device_memory: dict[str, int] = {}
    for r, ops in enumerate(ran):
        owners = [s for s in range(k) if device_of[s] == r]
        device_memory[names[owners[0]]] = sum(stages[s].param_bytes + stages[s].receive_bytes for s in owners) + int(max(
            sum(loss[s] for s in owners) + activation_peak(ops, *maps),
            step_peak([stages[s] for s in owners]), gather_peak(ops, *plain, gathered)))
    bubble = 1.0 - busy / (n_res * total) if total > 0 else 0.0
    timeline.sort(key=lambda e: (e.start_ms, e.stage))
    return SimulationResult(schedule, timeline, total, bubble, peaks, device_memory)


def simulate(plan: Plan, profile: Profile | None = None, schedule: str | None = None) -> SimulationResult:
    """Predict ``plan``'s training iteration under ``schedule`` (default: the plan's own).

    With a ``profile`` the stage costs are recomputed from it under ``schedule`` (after checking
    the plan matches it, and scaled to the plan's micro-batch when the plan records another one:
    [Note: micro-batch scaling]), so a plan of another schedule can be simulated under a
    zero-bubble one from a profile with the split; without one the plan's own per-stage
    breakdown is used.
    """
    schedule = plan.schedule if schedule is None else schedule
    options = plan.cost_options
    if profile is None:
        stages = list(plan.breakdown)
    else:
        profile = plan.profile_for(profile)
        where = {name: s for s, names in enumerate(plan.stages) for name in names}
        if schedule in SIMULATED_SCHEDULES:
            options = replace(options, schedule=schedule)
        try:
            stages = stage_costs(LayerCosts.from_profile(profile), [where[n] for n in profile.layers],
                                 plan.devices, options)
        except PartitionError as err:
            raise PlanError(str(err)) from None
    return simulate_stages(stages, chunks=plan.chunks, recompute=plan.recompute,
                           ms_per_byte=options.ms_per_byte, schedule=schedule,
                           devices=[d.name for d in plan.devices], merge=options.merge)
