"""The order in which each rank runs its forwards and backwards, per pipeline schedule.

[Note: schedule orders] These are the compute orders of torch.distributed.pipelining (torch
2.13), the runtime behind ``executor.DistributedPipeline``, written out torch-free so that the
simulator and the cost model can follow them exactly (tests/test_schedule_parity.py compares
them with torch's own, rank by rank):

    gpipe            ScheduleGPipe: F0 .. F(M-1), then B0 .. B(M-1)
    1f1b             Schedule1F1B: min(M, K - s) warm-up forwards, then one backward / one
                     forward until the forwards run out, then the remaining backwards
    interleaved1f1b  ScheduleInterleaved1F1B: V stages per rank (stage s on rank s % W);
                     warm-up forwards, 1F1B over the rank's stages in rounds, cool-down
    interleaved_zb   ScheduleInterleavedZeroBubble (ZB1P): interleaved1f1b's layout and rounds,
                     one warm-up forward less per hop, each backward split into I then W, rank r
                     deferring its first r weight gradients to fill the cool-down
    zbv              ScheduleZBVZeroBubble: two stages per rank in a V (rank r: r and 2W-1-r)
    dualpipev        ScheduleDualPipeV: the same V; overlapped forward + full backward pairs in
                     the steady state, split backwards at the ends

The last three are in autopipe/core/zero_bubble.py ([Note: split backward]); the runtime runs
some of their I that its W follows at once as one B (:func:`rank_order`, [Note: adjacent I
and W] in executor/spec.py), torch's own order is :func:`torch_rank_order`. An operation is
``(stage, kind, microbatch)`` with kind ``"F"`` (forward), ``"B"`` (the whole backward), or,
under the zero-bubble schedules, ``"I"`` and ``"W"`` (its input- and weight-gradient parts). ``executor.GPipe``
(one process, torchgpipe's order) runs the same forwards but drains its backwards in reverse,
B(M-1) .. B0; see [Note: stage memory] in autopipe/core/stage_memory.py for what that changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from autopipe.core import zero_bubble
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    merged_backward,
    stage_rank,
)

__all__ = ["Op", "rank_order", "stage_order", "rank_layout", "torch_rank_order"]

Op = tuple[int, str, int]  # (stage, "F", "B", "I" or "W", micro-batch)


def stage_order(schedule: str, stage: int, stages: int, chunks: int) -> list[Op]:
    """Stage ``stage``'s operations under ``gpipe`` or ``1f1b`` (one stage per rank)."""
    m = chunks
    if schedule == "gpipe":
        return [(stage, "F", i) for i in range(m)] + [(stage, "B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"stage_order runs one stage per rank; schedule={schedule!r} does not")
    warm = min(m, stages - stage)
    ops: list[Op] = [(stage, "F", i) for i in range(warm)]
    fwd, bwd = warm, 0
    while True:  # Schedule1F1B._step_microbatches: 1B, then 1F while forwards remain
        ops.append((stage, "B", bwd))
        bwd += 1
        if fwd == m:
            break
        ops.append((stage, "F", fwd))
        fwd += 1
    return ops + [(stage, "B", i) for i in range(bwd, m)]


def rank_order(schedule: str, rank: int, ranks: int, chunks: int, per_rank: int = 1,
               merge: str = "unwaited") -> list[Op]:
    """Rank ``rank``'s operations as the runtime runs them: :func:`torch_rank_order`, with the I
    and W that executor.spec.merged_backward merges under rule ``merge`` run as one B under the
    zero-bubble schedules ([Note: adjacent I and W] in executor/spec.py)."""
    return list(_rank_order(schedule, rank, ranks, chunks, per_rank, merge))


@lru_cache(maxsize=4096)
def _rank_order(schedule: str, rank: int, ranks: int, chunks: int, per_rank: int,
                merge: str) -> tuple[Op, ...]:
    """:func:`rank_order`, kept: the automatic search asks the same few orders thousands of times."""
    ops = torch_rank_order(schedule, rank, ranks, chunks, per_rank)
    return tuple(merged_backward(ops, schedule, ranks, merge) if schedule in ZERO_BUBBLE_SCHEDULES else ops)


def torch_rank_order(schedule: str, rank: int, ranks: int, chunks: int, per_rank: int = 1) -> list[Op]:
    """Rank ``rank``'s operations in torch's order; ``interleaved1f1b`` and ``interleaved_zb`` run
    ``per_rank`` stages on each of ``ranks`` ranks (stage s on rank s % ranks), ``zbv`` and
    ``dualpipev`` two in a V ([Note: stage to rank] in executor/spec.py), the others one stage
    per rank."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if schedule == "interleaved1f1b":
        return list(_interleaved(rank, ranks, per_rank, chunks))
    if schedule == "interleaved_zb":
        return list(zero_bubble.interleaved_zb(rank, ranks, per_rank, chunks))
    if schedule == "zbv":
        return list(zero_bubble.zbv(rank, ranks, chunks))
    if schedule == "dualpipev":
        return list(zero_bubble.dualpipev(rank, ranks, chunks))
    return stage_order(schedule, rank, ranks, chunks)


@lru_cache(maxsize=1024)
def _interleaved(rank: int, ranks: int, local: int, m: int) -> list[Op]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations and _get_1f1b_rank_ops
    (without zero bubble), with torch's idle slots (None) left out."""
    rounds = max(1, m // ranks)
    per_round = m // rounds
    warmup = min((local - 1) * per_round + 2 * (ranks - 1 - rank), m * local)
    steady = local * m - warmup

    def fwd_stage(step: int) -> int:
        return (step // per_round) % local * ranks + rank

    def bwd_stage(step: int) -> int:
        return (local - 1 - ((step - warmup) // per_round) % local) * ranks + rank

    fwd_next: dict[int, int] = {}
    bwd_next: dict[int, int] = {}
    ops: list[Op] = []

    def add(stage: int, kind: str, counter: dict[int, int]) -> None:
        mb = counter.get(stage, 0)
        counter[stage] = mb + 1
        ops.append((stage, kind, mb))

    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            add(fwd_stage(step), "F", fwd_next)
        if step >= warmup:
            add(bwd_stage(step), "B", bwd_next)
    return ops


def rank_layout(devices: Sequence[str], schedule: str = "interleaved1f1b") -> tuple[int, list[int]]:
    """Ranks and each stage's rank under a schedule that runs several stages per rank: the
    distinct device names, in order of first use, are the ranks, and stage s must run on
    ``executor.spec.stage_rank`` (s % ranks, or the V of zbv / dualpipev), as the runtime
    places them."""
    names = list(dict.fromkeys(devices))
    ranks = len(names)
    v = schedule in V_SCHEDULES
    if v and len(devices) != 2 * ranks:
        raise ValueError(f"{schedule} runs exactly 2 stages per rank, but {len(devices)} stages' devices "
                         f"name {ranks} ranks: {list(devices)}; give each rank's device to 2 stages")
    rank_of = [stage_rank(schedule if schedule in MULTI_STAGE_SCHEDULES else "interleaved1f1b", s, ranks)
               for s in range(len(devices))]
    if len(devices) % ranks or any(d != names[r] for d, r in zip(devices, rank_of, strict=True)):
        where = "stages r and 2W-1-r on rank r" if v else "stage s on rank s % ranks"
        raise ValueError(
            f"{schedule} runs {where}, but the stages' devices are "
            f"{list(devices)}; list the {ranks} ranks' devices so, e.g. {[names[r] for r in rank_of]}"
        )
    return ranks, rank_of
