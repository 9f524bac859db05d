"""What the automatic search chooses from: ranks, micro-batches, schedules, and their layouts.

[Note: automatic search] in search.py walks these; here is what each choice means on devices:
a schedule's stages per rank (one under gpipe and 1f1b, ``INTERLEAVED_PER_RANK`` under the
others), where each stage runs ([Note: stage to rank] in executor/spec.py), and which schedules
a profile can be planned for at all (the zero-bubble ones need its split backward: [Note: split
backward time] in autopipe/core/cost.py), with the reason for each it cannot. And what it
finds: a configuration (``Config``), its split simulated (``Result``), and the next best of them
that ``plan.explain()`` lists (:func:`alternatives`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.plan import Alternative
from autopipe.solvers.stage_dp import Split
from executor.spec import MULTI_STAGE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, stage_rank

__all__ = ["INTERLEAVED_PER_RANK", "Setting", "chunk_candidates", "pick_devices", "plan_devices",
           "stages_per_rank", "unplannable", "Config", "Result", "alternatives"]

INTERLEAVED_PER_RANK = 2  # stages per rank of a multi-stage schedule (the runtime's default; the V's)


@dataclass(frozen=True)
class Setting:
    """What the search may choose from (each list has one entry when fixed)."""

    ranks: list[int]  # devices used (one stage each, or INTERLEAVED_PER_RANK under a multi-stage schedule)
    chunks: list[int]
    schedules: list[str]
    checkpoints: list[str | tuple[str, ...]]  # "auto" (per stage), a mode, or one per stage
    batch_size: int | None
    optimizer: str = "adam"
    bandwidth: float | None = 10e9
    ties: str = "share"
    stages: int | None = None  # a fixed stage count: a multi-stage schedule then uses stages / 2 ranks
    data_parallel: int = 1  # replicas, each on its own pool ([Note: pipeline x data parallel])
    dp_mode: str = "ddp"


def stages_per_rank(schedule: str) -> int:
    """Stages on each rank as the search and ``partition(stages=K)`` lay them out."""
    return INTERLEAVED_PER_RANK if schedule in MULTI_STAGE_SCHEDULES else 1


def chunk_candidates(batch_size: int, max_chunks: int) -> list[int]:
    """Micro-batch counts that cut ``batch_size`` rows into equal micro-batches, at most
    ``max_chunks`` of them."""
    return [m for m in range(1, min(batch_size, max_chunks) + 1) if batch_size % m == 0]


def pick_devices(pool: Sequence[DeviceSpec], w: int) -> list[DeviceSpec]:
    """The ``w`` fastest devices (then roomiest), in the pool's order."""
    if w == len(pool):
        return list(pool)
    rank = sorted(range(len(pool)), key=lambda i: (-pool[i].speed, -(pool[i].memory or math.inf), i))
    keep = set(rank[:w])
    return [d for i, d in enumerate(pool) if i in keep]


def plan_devices(schedule: str, ranks: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Each stage's device: the ranks themselves, or under a multi-stage schedule each rank
    ``stages_per_rank`` times, as ``executor.spec.stage_rank`` places the stages."""
    w = len(ranks)
    return [ranks[stage_rank(schedule, s, w)] for s in range(stages_per_rank(schedule) * w)]


def unplannable(schedules: Sequence[str], costs: LayerCosts) -> dict[str, str]:
    """The schedules of ``schedules`` that ``costs`` cannot be planned for, each with why."""
    if costs.bwd_input is not None:
        return {}
    return {s: "the profile has no split backward (bwd_input_ms ...): profile again to weigh it"
            for s in schedules if s in ZERO_BUBBLE_SCHEDULES}


ALTERNATIVES = 5  # the next best configurations plan.explain() lists


@dataclass(frozen=True)
class Config:
    """One configuration the search may solve: its schedule, ranks, micro-batches, and the lower
    bound no split of it beats."""

    schedule: str
    ranks: int
    chunks: int
    bound: float


@dataclass(frozen=True)
class Result:
    """A configuration's split under one recompute variant, simulated."""

    config: Config
    recompute: str | tuple[str, ...]  # the variant searched
    split: Split
    time: float
    memory: int  # the highest device peak
    merge: str = "unwaited"  # the zero-bubble merge rule it was timed with ([Note: adjacent I and W])
    alone: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # recompute_layers, segment_starts


def alternatives(ranked: list[Result], best: Result, replicas: int) -> list[Alternative]:
    """The next best configurations, then the best of each schedule not among them, so that
    ``plan.explain()`` shows every schedule the search weighed."""
    out: list[Alternative] = []
    seen = {(best.config, tuple(best.split.modes))}
    shown = {best.config.schedule}
    for r in ranked:
        key = (r.config, tuple(r.split.modes))
        if key in seen or (len(out) >= ALTERNATIVES and r.config.schedule in shown):
            continue
        seen.add(key)
        shown.add(r.config.schedule)
        c = r.config
        k = len(r.split.modes)
        modes: str | list[str] = r.split.modes[0] if len(set(r.split.modes)) == 1 else list(r.split.modes)
        note = ("blocks recomputed alone" if r.alone[0] else  # [Note: blocks recomputed alone]
                "" if r.recompute == "auto" else "one mode for all stages")
        if len(out) >= ALTERNATIVES:
            note = f"best {c.schedule}" + (f", {note}" if note else "")
        out.append(Alternative(k, c.chunks, c.schedule, modes, r.time, r.split.bottleneck, r.memory, note,
                               replicas))
    return out
