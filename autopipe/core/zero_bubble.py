"""The zero-bubble schedules' per-rank orders, as torch.distributed.pipelining (2.13) computes them.

[Note: split backward] ([Note: zero-bubble schedules] in executor/spec.py) These schedules run a
stage's backward of one micro-batch as two operations: ``"I"``, its input gradients (torch's
BACKWARD_INPUT, ``stage_backward_input``: ``autograd.grad`` with ``inputs=`` the stage's inputs,
the graph retained; the Zero Bubble paper's B), which the previous stage waits for, and later
``"W"``, its weight gradients (BACKWARD_WEIGHT, ``stage_backward_weight``: from the gradients
the first pass left at the weights' nodes). ``"B"`` stays what it is in every other schedule,
the whole backward in one pass (FULL_BACKWARD); DualPipeV runs some of those too. Torch's
first stage skips its I (its input needs no gradient) and runs the whole backward in its W
(``PipelineStage.backward_weight_one_chunk``); the cost model charges it so
(``cost.split_backward_ms``). Until its W a micro-batch keeps its activations (the retained
graph) and the gradients W starts from ([Note: stage memory] in stage_memory.py).

Each function below is the torch method named in its docstring, written out on plain tuples
(tests/test_schedule_parity.py constructs torch's schedule classes on fake stages and compares
``pipeline_order`` rank by rank), with torch's idle slots (None) left out: they only pad
torch's own step grid, and the simulator waits for each operation's inputs instead. DualPipeV's
OVERLAP_F_B action (a forward of one stage with a full backward of the other) is run by torch's
``_PipelineScheduleRuntime`` as its two sub-actions in turn, unless a custom function is
registered for it (torch 2.13 registers none), so it is written as those two operations.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["dualpipev", "interleaved_zb", "zbv"]

Op = tuple[int, str, int]  # (stage, kind, micro-batch): see autopipe.core.schedules


@lru_cache(maxsize=1024)
def interleaved_zb(rank: int, ranks: int, local: int, m: int) -> list[Op]:
    """ScheduleInterleavedZeroBubble._calculate_single_rank_operations: torch's
    ``_get_1f1b_rank_ops(..., enable_zero_bubble=True)`` with warm-up factor 1 and
    ``num_1f1b_microbatches = rank``: a rank runs ``rank`` input gradients before its first
    weight gradient, then one W after each I, the rest at the end (stage s on rank s % W)."""
    rounds = max(1, m // ranks)
    per_round = m // rounds
    warmup = min((local - 1) * per_round + (ranks - 1 - rank), m * local)
    steady = local * m - warmup

    def fwd_stage(step: int) -> int:
        return (step // per_round) % local * ranks + rank

    def bwd_stage(step: int) -> int:
        return (local - 1 - ((step - warmup) // per_round) % local) * ranks + rank

    next_mb: dict[tuple[int, str], int] = {}
    ops: list[Op] = []

    def add(stage: int, kind: str) -> None:
        mb = next_mb.get((stage, kind), 0)
        next_mb[stage, kind] = mb + 1
        ops.append((stage, kind, mb))

    backward_steps: list[int] = []
    weights = 0
    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            add(fwd_stage(step), "F")
        if step >= warmup:
            add(bwd_stage(step), "I")
            backward_steps.append(step)
            if step - warmup >= rank:
                add(bwd_stage(backward_steps[weights]), "W")
                weights += 1
    for step in backward_steps[weights:]:
        add(bwd_stage(step), "W")
    return ops


@lru_cache(maxsize=1024)
def zbv(rank: int, ranks: int, m: int) -> list[Op]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations: rank r holds stages r (chunk 0)
    and 2W - 1 - r (chunk 1); the order is built for ``max(2W - 1, M)`` micro-batches and the
    operations on micro-batches >= M are dropped, as torch does."""
    n_micro = max(2 * ranks - 1, m)
    s0, s1 = rank, 2 * ranks - 1 - rank
    count = {(s, kind): 0 for s in (s0, s1) for kind in "FIW"}
    ops: list[Op] = []

    def add(stage: int, kind: str, mb: int | None = None) -> None:
        if mb is None:
            mb = count[stage, kind]
            count[stage, kind] = mb + 1
        ops.append((stage, kind, mb))

    for _ in range(2 * (ranks - rank) - 1):
        add(s0, "F")
    for _ in range(rank):
        add(s1, "F")
        add(s0, "F")
    for _ in range(ranks - rank):
        add(s1, "F")
        mb = count[s1, "I"]
        add(s1, "I")
        add(s1, "W", mb)
    while count[s1, "F"] < count[s0, "F"] or count[s0, "F"] < n_micro:
        if count[s0, "F"] < n_micro:
            add(s0, "F")
        mb = count[s0, "I"]
        add(s0, "I")
        add(s0, "W", mb)
        add(s1, "F")
        mb = count[s1, "I"]
        add(s1, "I")
        add(s1, "W", mb)
    w0, w1 = count[s0, "I"], count[s1, "I"]  # torch's w0_cnt, w1_cnt: W of the cool-down's I
    for _ in range(rank):
        add(s0, "I")
        add(s1, "I")
    for _ in range(ranks - rank):
        add(s0, "I")
        add(s0, "W", w0)
        w0 += 1
    for mb in range(w1, count[s1, "I"]):
        add(s1, "W", mb)
    for mb in range(w0, count[s0, "I"]):
        add(s0, "W", mb)
    return [op for op in ops if op[2] < m]


@lru_cache(maxsize=1024)
def dualpipev(rank: int, ranks: int, m: int) -> list[Op]:
    """ScheduleDualPipeV._calculate_single_rank_operations (DeepSeek's DualPipeV): rank r holds
    stages r and 2W - 1 - r; steps 1-8 as torch numbers them, OVERLAP_F_B as its forward then its
    full backward ([Note: split backward]). A full backward advances the stage's input and
    weight counters; an I queues its W, run oldest first where the order says."""
    s0, s1 = rank, 2 * ranks - 1 - rank
    count: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # torch's weight_queue: (stage, micro-batch)
    ops: list[Op] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        mb = count.get(key, 0)
        ops.append((stage, kind, mb))
        count[key] = mb + 1
        if kind == "B":
            count[stage, "W"] = count.get((stage, "W"), 0) + 1
        elif kind == "I":
            pending.append((stage, mb))

    def weight() -> None:
        if pending:
            stage, mb = pending.pop(0)
            ops.append((stage, "W", mb))
            count[stage, "W"] = count.get((stage, "W"), 0) + 1

    def overlapped(forward: int, backward: int) -> None:  # OVERLAP_F_B: F, then a full B
        add(forward, "F")
        add(backward, "B")

    for _ in range((ranks - rank - 1) * 2):  # step 1: F0
        add(s0, "F")
    for _ in range(rank + 1):  # step 2: F0 F1
        add(s0, "F")
        add(s1, "F")
    for _ in range(ranks - rank - 1):  # step 3: I1 W F1
        add(s1, "I")
        weight()
        add(s1, "F")
    for i in range(m - ranks * 2 + rank + 1):  # step 4: F0 B1, F1 B0 (overlapped)
        if i == 0 and rank == ranks - 1:  # torch does not overlap these two
            add(s0, "F")
            add(s1, "B")
        else:
            overlapped(s0, s1)
        overlapped(s1, s0)
    for _ in range(ranks - rank - 1):  # step 5: B1, F1 B0
        add(s1, "B")
        overlapped(s1, s0)
    split = False
    step_6 = rank + 1
    for i in range(step_6):  # step 6: B1 B0, the second half split into I and W
        if i == step_6 // 2 and rank % 2 == 1:
            split = True
        add(s1, "I" if split else "B")
        if i == step_6 // 2 and rank % 2 == 0:
            split = True
        add(s0, "I" if split else "B")
    for _ in range(ranks - rank - 1):  # step 7: W, B0
        weight()
        add(s0, "I" if split else "B")
    for _ in range(rank + 1):  # step 8: W
        weight()
    return ops
