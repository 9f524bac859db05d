"""The rules the runtime and the planner must agree on, torch-free: one copy, imported by both.

    RECOMPUTE_MODES, recomputed_microbatches()    which micro-batches are recomputed
    check_stage_recompute()                       one recompute mode per stage
    renamed_recompute()                           checkpoint= still taken, with a warning
    microbatch_sizes()                            how a batch is cut into micro-batches
    PHASES, TimelineEvent                         the spans of a (predicted or measured) timeline
    DATA_PARALLEL_MODES, DATA_PARALLEL_PHASES     how replicas of a pipeline share gradients, and
                                                  the collectives' timeline phases
    SCHEDULES, check_schedule()                   the pipeline schedules the runtime runs, and
                                                  the stage / micro-batch counts each accepts
    ZERO_BUBBLE_SCHEDULES, stage_rank()           the schedules that split each backward in
                                                  two, and which rank runs which stage
    MERGE_RULES, merged_backward(), merge_rules() where they run a backward whole after all
    PRECISIONS, check_precision()                 what a pipeline computes in: fp32, or autocast
                                                  to bf16 / fp16 over fp32 master parameters

The planner (``autopipe.core``) predicts what the executor does; any rule it had to copy could
drift from the executor's. So the rules live here, in a module that imports neither torch nor
``autopipe`` (``import executor.spec`` does not import torch: see [Note: lazy executor] in
executor/__init__.py). Functions raise ValueError; each caller re-raises in its own error class.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RECOMPUTE_MODES",
    "renamed_recompute",
    "DATA_PARALLEL_MODES",
    "DATA_PARALLEL_PHASES",
    "MERGE_RULES",
    "PHASES",
    "PRECISIONS",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "TimelineEvent",
    "V_SCHEDULES",
    "ZERO_BUBBLE_SCHEDULES",
    "check_recompute_mode",
    "check_chunks",
    "check_merge_rule",
    "check_precision",
    "check_schedule",
    "check_stage_recompute",
    "merge_rules",
    "merged_backward",
    "microbatch_sizes",
    "recomputed_microbatches",
    "stage_rank",
]

RECOMPUTE_MODES: tuple[str, ...] = ("always", "except_last", "never")

# How replicas of a pipeline keep a stage's parameters equal: "ddp" (DistributedDataParallel,
# an all-reduce of the gradients) or "fsdp" (FSDP2 fully_shard: sharded parameters, gradients and
# optimizer state). [Note: pipeline x data parallel] in autopipe/core/data_parallel.py.
DATA_PARALLEL_MODES: tuple[str, ...] = ("ddp", "fsdp")

# The data-parallel collectives of a stage, as timeline phases.
DATA_PARALLEL_PHASES: tuple[str, ...] = ("allgather", "allreduce", "reducescatter")

# Phases of a timeline, in drawing order (bottom to top of a stacked bar). Under the zero-bubble
# schedules "backward" is a backward's input-gradient part and "weight" its weight-gradient part
# ([Note: split backward] in autopipe/core/zero_bubble.py).
PHASES: tuple[str, ...] = ("forward", "backward", "weight", "recompute", "transfer", *DATA_PARALLEL_PHASES)

# [Note: zero-bubble schedules] torch.distributed.pipelining's ScheduleInterleavedZeroBubble
# ("interleaved_zb", ZB1P), ScheduleZBVZeroBubble ("zbv") and ScheduleDualPipeV ("dualpipev")
# split a stage's backward into its input gradients (torch's BACKWARD_INPUT, run first: the
# previous stage waits for it) and its weight gradients (BACKWARD_WEIGHT, run later, where the
# pipeline would idle), after Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024).
ZERO_BUBBLE_SCHEDULES: tuple[str, ...] = ("interleaved_zb", "zbv", "dualpipev")

# Schedules of the distributed runtime; executor.GPipe (one process) always runs "gpipe".
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved1f1b", *ZERO_BUBBLE_SCHEDULES)

# Schedules whose ranks may hold several stages, and of them those whose two stages per rank
# lie in a V ([Note: stage to rank]).
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
V_SCHEDULES: tuple[str, ...] = ("zbv", "dualpipev")


# Which adjacent input- and weight-gradient parts of a zero-bubble schedule run as one whole
# backward ([Note: adjacent I and W]): "unwaited" those whose input gradient no other rank waits
# for, "adjacent" every I that its own W follows at once. A plan records its rule
# (``Plan.merge_backward``), chosen by simulated time.
MERGE_RULES: tuple[str, ...] = ("unwaited", "adjacent")


def merge_rules(schedule: str) -> tuple[str, ...]:
    """The merge rules worth weighing under ``schedule``: both under a zero-bubble one, else the
    default alone (no halves to merge)."""
    return MERGE_RULES if schedule in ZERO_BUBBLE_SCHEDULES else MERGE_RULES[:1]


def check_merge_rule(rule: str) -> str:
    """``rule`` if it is one of MERGE_RULES, else ValueError naming them."""
    if rule not in MERGE_RULES:
        raise ValueError(f"merge_backward={rule!r}: choose one of {list(MERGE_RULES)}")
    return rule


def merged_backward(ops: list[tuple[int, str, int]], schedule: str, ranks: int,
                    rule: str = "unwaited") -> list[tuple[int, str, int]]:
    """[Note: adjacent I and W] A rank's ``(stage, kind, micro-batch)`` operations under a
    zero-bubble ``schedule`` on ``ranks`` ranks as the runtime runs them: every input-gradient
    part ``"I"`` that its own weight-gradient part ``"W"`` follows at once merged into one whole
    backward ``"B"``, under ``rule`` "unwaited" only on a stage whose input gradient no other
    rank waits for (the first stage, which sends none, or a stage whose previous stage shares its
    rank: the V's bottom), under "adjacent" on every stage. A split exists to run the W later,
    where the rank would idle; where nothing comes between the two, splitting only costs (the
    halves take more than the whole backward: [Note: split backward time] in
    autopipe/core/cost.py).
    Where another rank waits for the I's gradient, merging sends it only after the W: whether
    that loses more than the split costs depends on the stages (simulated, it lost on the
    202-layer DAG of benchmarks/zero_bubble_plan.py and won on 2-rank chains at M = 8), so the
    planner simulates both rules and the plan records the faster (``Plan.merge_backward``). On
    2 ranks ZB-V merges half of every rank's backwards under "unwaited". (torch 2.13 writes
    ``_merge_bw``, which merges every adjacent pair, and does not call it.)"""
    check_merge_rule(rule)

    def local(stage: int) -> bool:
        return (rule == "adjacent" or stage == 0
                or stage_rank(schedule, stage - 1, ranks) == stage_rank(schedule, stage, ranks))

    out: list[tuple[int, str, int]] = []
    i = 0
    while i < len(ops):
        stage, kind, microbatch = ops[i]
        if kind == "I" and i + 1 < len(ops) and ops[i + 1] == (stage, "W", microbatch) and local(stage):
            out.append((stage, "B", microbatch))
            i += 2
        else:
            out.append(ops[i])
            i += 1
    return out


def stage_rank(schedule: str, stage: int, ranks: int) -> int:
    """[Note: stage to rank] The rank of W that runs ``stage``: the V schedules place exactly two
    stages on each rank, rank r running stages r and 2W - 1 - r (torch's
    ``generate_stage_to_rank_mapping(style="v")``: stages W - 1 and W, the V's bottom, share the
    last rank and pass values without a message); every other schedule runs stage s on rank
    s % W (one stage per rank under gpipe and 1f1b)."""
    if schedule in V_SCHEDULES:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


# What a pipeline computes in ([Note: mixed precision] in executor/precision.py): "fp32", or
# autocast to "bf16" / "fp16" inside every stage while parameters, gradients, their reduction
# and the optimizer state stay fp32. Only fp16 needs loss scaling.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

# Bytes of one element in each precision's compute dtype.
PRECISION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_precision(precision: object) -> str:
    """``precision`` if it is one of PRECISIONS, else a one-line ValueError."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; use one of {', '.join(PRECISIONS)}")
    return precision


def check_recompute_mode(mode: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute={mode!r} is not a recompute mode; use one of {', '.join(RECOMPUTE_MODES)}"
        )


def recomputed_microbatches(mode: str, chunks: int) -> int:
    """How many of ``chunks`` micro-batches a stage recomputes in backward (torchgpipe's rule).

    ``always``: all of them; ``except_last``: all but one, the micro-batch back-propagated
    first; ``never``: none. Which R: :func:`is_recomputed` ([Note: which micro-batches recompute]).
    """
    check_recompute_mode(mode)
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def is_recomputed(microbatch: int, chunks: int, recomputed: int) -> bool:
    """[Note: which micro-batches recompute] A stage recomputes the R micro-batches whose
    backward comes LAST, so that the one back-propagated first (torchgpipe's "last": its
    backward starts right after its forward) keeps its activations and frees them at once.
    torch.distributed.pipelining's schedules back-propagate micro-batch 0 first, so under them
    (the distributed runtime, and the simulator and cost model, which follow their order) these
    are micro-batches ``M - R .. M - 1``. executor.GPipe back-propagates in reverse (M - 1
    first) and recomputes ``0 .. R - 1``: the mirror image, with the same peak memory.
    """
    return microbatch >= chunks - recomputed


def renamed_recompute(recompute: Any, checkpoint: Any, where: str) -> Any:
    """[Note: recompute, not checkpoint] Recomputation is ``recompute=`` everywhere; "checkpoint"
    means saved training state (``save_checkpoint``, ``--checkpoint-dir``), as in torchtitan,
    DeepSpeed and Megatron. Until the next release an entry point still takes ``checkpoint=``:
    its value is used, with one DeprecationWarning line that says what to write instead."""
    if checkpoint is None:
        return recompute
    warnings.warn(f"{where}(checkpoint={checkpoint!r}) is now {where}(recompute={checkpoint!r}); "
                  "checkpoint= will be removed in the next release", DeprecationWarning, stacklevel=3)
    return checkpoint


def check_stage_recompute(recompute: object, stages: int) -> list[str]:
    """[Note: per-stage recomputation] One recompute mode per stage, from one mode for every
    stage or a list (or tuple) with one mode per stage.

    Recomputation is local to a stage: a checkpointed stage saves its own inputs and replays its
    own forward, so stage ``s`` recomputes ``R_s = recomputed_microbatches(modes[s], M)``
    micro-batches ([Note: which micro-batches recompute]) whatever its neighbours do, and any mix of
    modes leaves the same loss and gradients; only time and memory differ, per stage. A planner
    can therefore pay for recomputation only on the stages where memory binds.
    """
    if isinstance(recompute, str):
        check_recompute_mode(recompute)
        return [recompute] * stages
    if not isinstance(recompute, list | tuple):
        raise ValueError(
            f"recompute={recompute!r} is neither a mode nor a list of modes; pass one of "
            f"{', '.join(RECOMPUTE_MODES)}, or a list with one per stage"
        )
    modes = list(recompute)
    if len(modes) != stages:
        raise ValueError(
            f"recompute lists {len(modes)} mode(s) for {stages} stage(s); give one mode per "
            "stage, or one mode for all of them"
        )
    for s, mode in enumerate(modes):
        if not isinstance(mode, str) or mode not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute[{s}]={mode!r} is not a recompute mode; use one of "
                f"{', '.join(RECOMPUTE_MODES)}"
            )
    return modes


def check_schedule(schedule: str, stages: int, ranks: int, chunks: int) -> None:
    """What torch.distributed.pipelining (2.13) accepts: ``gpipe`` and ``1f1b`` run one stage per
    rank, ``1f1b`` needs at least as many micro-batches as stages (Schedule1F1B refuses fewer);
    ``interleaved1f1b`` and ``interleaved_zb`` give every rank the same number of stages (one
    or more) and need ``chunks`` to be a multiple of their rounds, ``max(1, chunks // ranks)``
    (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble); ``zbv`` and ``dualpipev`` run
    exactly two stages per rank in a V ([Note: stage to rank]), ``dualpipev`` on at least as
    many micro-batches as stages (ScheduleDualPipeV; ScheduleZBVZeroBubble takes any)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if schedule in V_SCHEDULES:
        if stages != 2 * ranks:
            raise ValueError(f"schedule={schedule!r} runs exactly 2 stages per rank (rank r: stages r and "
                             f"2W-1-r): {ranks} ranks need {2 * ranks} stages, not {stages}; use "
                             f"{max(stages // 2, 1)} ranks for {2 * max(stages // 2, 1)} stages")
        if schedule == "dualpipev" and chunks < stages:
            raise ValueError(f"schedule='dualpipev' needs chunks >= stages ({stages}), got chunks={chunks}; "
                             f"use chunks={stages} or more, or schedule='zbv'")
        return
    if schedule not in MULTI_STAGE_SCHEDULES and stages != ranks:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank: {stages} stages need "
                         f"{stages} ranks, not {ranks}; use schedule='interleaved1f1b' for more")
    if schedule == "1f1b" and chunks < stages:
        raise ValueError(f"schedule='1f1b' needs chunks >= stages ({stages}), got chunks={chunks}; "
                         f"use more micro-batches or schedule='gpipe'")
    if schedule in MULTI_STAGE_SCHEDULES:
        if stages % ranks:
            raise ValueError(f"schedule={schedule!r} gives every rank the same number of "
                             f"stages: {stages} stages cannot be shared by {ranks} ranks")
        rounds = max(1, chunks // ranks)
        if chunks % rounds:
            raise ValueError(f"schedule={schedule!r} needs chunks to be a multiple of its "
                             f"rounds (chunks // ranks = {rounds}), got chunks={chunks}; use "
                             f"chunks={ranks * rounds}")


def check_chunks(chunks: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}; pass chunks=1 or more")


def microbatch_sizes(batch: int, chunks: int) -> list[int]:
    """[Note: micro-batch sizes] The sizes of the ``chunks`` micro-batches of a batch of ``batch``.

    Exactly ``chunks`` micro-batches whose sizes differ by at most one, the larger first
    (``torch.tensor_split``'s cut: B=10, M=4 -> 3, 3, 2, 2). ``torch.chunk`` (torchgpipe's
    choice) may return fewer than M (B=10, M=4 -> 3, 3, 3, 1; B=5, M=4 -> 2, 2, 1), and then the
    schedule, the cost model and deferred BatchNorm would see another M than was asked for. The
    first micro-batch is the largest, ``ceil(B / M)`` rows: the one profiles and plans describe.
    """
    check_chunks(chunks)
    if batch < chunks:
        raise ValueError(
            f"chunks={chunks} > batch size {batch}: micro-batches would be empty; "
            f"use chunks <= {batch}"
        )
    q, r = divmod(batch, chunks)
    return [q + 1] * r + [q] * (chunks - r)


@dataclass(frozen=True)
class TimelineEvent:
    """[Note: timeline events] One span of work: ``phase`` (one of PHASES) of ``microbatch`` on
    ``stage``, from ``start_ms`` to ``end_ms`` after the start of the iteration.

    The simulator predicts these and executor.GPipe measures them (``measured=True``), so a
    predicted and a measured timeline are the same kind of value and overlay on one plot.
    """

    stage: int
    microbatch: int
    phase: str
    start_ms: float
    end_ms: float
    measured: bool = False

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms
