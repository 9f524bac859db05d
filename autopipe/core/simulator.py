"""Event simulation of a pipeline schedule: per-stage timeline, iteration time, peak memory.

Each stage runs one operation at a time, in the order its schedule fixes:

    gpipe  F0 F1 ... F(M-1)  B(M-1) ... B0                 (fill, then drain; torchgpipe)
    1f1b   min(K-1-s, M) warm-up forwards, then one forward / one backward, then the rest

A forward of micro-batch m on stage s waits for stage s-1's forward of m and its transfer; a
backward waits for stage s+1's backward of m and the gradient's transfer. A checkpointed
micro-batch (see [Note: stage memory] in autopipe.core.cost) is recomputed right before its backward,
once the gradient has arrived. After a forward the stage sends its output activations, after a
backward its input gradients; sends occupy the sender ([Note: transfer cost]).

Memory: a stage holds its parameter state throughout; a micro-batch's activations are held from
its forward to the end of its backward: the full ``saved`` bytes, or only the stage input while
checkpointed plus ``saved`` again from its recomputation on.

The events are executor.spec.TimelineEvent, the value the executor measures, so a predicted and a
measured timeline can be drawn on one plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopipe.core.cost import CostOptions, LayerCosts, StageCost, stage_costs
from autopipe.errors import PlanError
from executor.spec import TimelineEvent, recomputed_microbatches

if TYPE_CHECKING:
    from autopipe.core.plan import Plan
    from autopipe.core.profile_table import Profile

__all__ = ["SIMULATED_SCHEDULES", "SimulationResult", "simulate", "simulate_stages"]

# The runtime's schedules (executor.spec.SCHEDULES) that this simulator models.
SIMULATED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


@dataclass(frozen=True)
class SimulationResult:
    schedule: str
    timeline: list[TimelineEvent]
    iteration_time: float  # ms
    bubble_fraction: float  # idle share of K x iteration_time
    peak_memory: list[int]  # bytes per stage

    def summary(self) -> str:
        """A few lines: iteration time, bubble and each stage's busy time and peak memory."""
        from autopipe.core.units import format_bytes

        k = len(self.peak_memory)
        lines = [f"schedule {self.schedule}: iteration {self.iteration_time:.3f} ms, "
                 f"bubble {100 * self.bubble_fraction:.1f}% over {k} stages"]
        for s in range(k):
            events = [e for e in self.timeline if e.stage == s]
            busy = sum(e.end_ms - e.start_ms for e in events)
            first = min((e.start_ms for e in events), default=0.0)
            last = max((e.end_ms for e in events), default=0.0)
            lines.append(f"  stage {s}: busy {busy:.3f} ms from {first:.3f} to {last:.3f} ms, "
                         f"peak memory {format_bytes(self.peak_memory[s])}")
        return "\n".join(lines)


def _order(schedule: str, s: int, k: int, m: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    warm = min(k - 1 - s, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warm, m)]


def _clock(op: tuple[str, int], s: int) -> tuple[int, int]:
    """Fill-drain priority of an operation: forwards by clock cycle (micro-batch + stage), then
    stage; backwards in the reverse order, which is the order autograd runs them."""
    kind, i = op
    return (i + s, s) if kind == "F" else (-(i + s), -s)


def simulate_stages(
    stages: Sequence[StageCost],
    *,
    chunks: int,
    checkpoint: str,
    ms_per_byte: float,
    schedule: str = "gpipe",
    devices: Sequence[str] | None = None,
) -> SimulationResult:
    """Simulate one training iteration of stages with the given per-micro-batch costs.

    ``devices`` names each stage's device; stages with the same name share it and never run at
    the same time (see [Note: shared devices]). Default: every stage on its own device.
    """
    if schedule not in SIMULATED_SCHEDULES:
        raise PlanError(f"schedule={schedule!r} is not simulated; choose one of {list(SIMULATED_SCHEDULES)}")
    k, m = len(stages), chunks
    names = list(devices) if devices is not None else [f"stage{s}" for s in range(k)]
    if len(names) != k:
        raise PlanError(f"{len(names)} devices for {k} stages: give one device per stage")
    resource = [names.index(name) for name in names]  # stages on one device share a clock
    rec_n = recomputed_microbatches(checkpoint, m)
    fwd_ready: dict[tuple[int, int], float] = {(0, i): 0.0 for i in range(m)}
    bwd_ready: dict[tuple[int, int], float] = {}
    orders = [_order(schedule, s, k, m) for s in range(k)]
    pos, free = [0] * k, [0.0] * k
    timeline: list[TimelineEvent] = []
    held: list[list[tuple[float, int]]] = [[] for _ in range(k)]  # (time, +/- bytes)

    def run(s: int, i: int, phase: str, start: float, dur: float) -> float:
        if dur > 0 or phase != "transfer":
            timeline.append(TimelineEvent(s, i, phase, start, start + dur))
        free[resource[s]] = start + dur
        return start + dur

    def ready(s: int) -> float | None:
        op, i = orders[s][pos[s]]
        when = (fwd_ready if op == "F" else bwd_ready).get((s, i))
        return None if when is None else max(free[resource[s]], when)

    # [Note: shared devices] List scheduling: repeatedly run the ready operation that can start
    # first (ties in fill-drain clock order, reversed for backward as autograd runs it; see
    # _clock). With one device
    # per stage this gives the same times as running each stage's order independently; stages
    # on one device (executor.GPipe with devices=["cpu", "cpu"]) take turns, as they do there.
    while True:
        candidates = [
            (start, _clock(orders[s][pos[s]], s), s)
            for s in range(k)
            if pos[s] < len(orders[s]) and (start := ready(s)) is not None
        ]
        if not candidates:
            break
        start, _, s = min(candidates)
        st = stages[s]
        op, i = orders[s][pos[s]]
        ckpt = i < rec_n
        if op == "F":
            end = run(s, i, "forward", start, st.fwd_ms)
            held[s].append((end, st.input_bytes if ckpt else st.saved_bytes))
            if s == k - 1:
                bwd_ready[s, i] = end
            else:
                fwd_ready[s + 1, i] = run(s, i, "transfer", end, st.output_bytes * ms_per_byte)
        else:
            if ckpt:
                held[s].append((start, st.saved_bytes))
                start = run(s, i, "recompute", start, st.fwd_ms)
            end = run(s, i, "backward", start, st.bwd_ms)
            held[s].append((end, -(st.input_bytes + st.saved_bytes) if ckpt
                            else -st.saved_bytes))
            if s > 0:
                bwd_ready[s - 1, i] = run(s, i, "transfer", end, st.input_bytes * ms_per_byte)
        pos[s] += 1
    if any(p < len(o) for p, o in zip(pos, orders, strict=True)):  # pragma: no cover - a bug
        raise RuntimeError("schedule deadlocked")
    total = max((e.end_ms for e in timeline), default=0.0)
    busy = sum(e.end_ms - e.start_ms for e in timeline)
    peaks = []
    for s, st in enumerate(stages):
        level = peak = 0
        for _, delta in sorted(held[s], key=lambda x: (x[0], x[1])):  # frees before allocs at a tie
            level += delta
            peak = max(peak, level)
        peaks.append(st.param_bytes + peak)
    bubble = 1.0 - busy / (k * total) if total > 0 else 0.0
    timeline.sort(key=lambda e: (e.start_ms, e.stage))
    return SimulationResult(schedule, timeline, total, bubble, peaks)


def simulate(plan: Plan, profile: Profile | None = None, schedule: str = "gpipe") -> SimulationResult:
    """Predict ``plan``'s training iteration under ``schedule`` ("gpipe" or "1f1b").

    With a ``profile`` the stage costs are recomputed from it (after checking the plan matches
    it); without one the plan's own per-stage breakdown is used.
    """
    options = CostOptions(plan.chunks, plan.checkpoint, plan.optimizer, plan.bandwidth, plan.ties)
    if profile is None:
        stages = list(plan.breakdown)
    else:
        plan.check(profile.layers, profile.fingerprint)
        where = {name: s for s, names in enumerate(plan.stages) for name in names}
        stages = stage_costs(LayerCosts.from_profile(profile), [where[n] for n in profile.layers],
                             plan.devices, options)
    return simulate_stages(stages, chunks=plan.chunks, checkpoint=plan.checkpoint,
                           ms_per_byte=options.ms_per_byte, schedule=schedule,
                           devices=[d.name for d in plan.devices])
