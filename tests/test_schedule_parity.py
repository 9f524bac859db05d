"""The simulator runs each rank's forwards and backwards in torch.distributed.pipelining's order.

[Note: schedule orders] (autopipe/core/schedules.py) writes torch's ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and
ScheduleDualPipeV orders out torch-free. Here torch's own code decides: the single-stage
schedules run their real ``_step_microbatches`` against a stage that only records what it is
asked to compute (no process group, no tensors), the interleaved one is asked for its per-rank
actions, and the zero-bubble ones are CONSTRUCTED on fake stages (a namespace with a group size,
rank, stage index and count: no process group), which computes every rank's order, adds
torch's bubbles and lowers it to the order the runtime executes (``pipeline_order_with_comms``);
its compute actions, an OVERLAP_F_B as its two sub-actions in turn, are the expected order. The
simulator's timeline must execute exactly that order on every rank, for stages of uneven cost.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch_pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

from autopipe.core.cost import StageCost  # noqa: E402
from autopipe.core.schedules import rank_order, torch_rank_order  # noqa: E402
from autopipe.core.simulator import simulate_stages  # noqa: E402
from executor._torch_compat import merge_adjacent_backward  # noqa: E402
from executor.spec import MERGE_RULES, check_schedule, merged_backward, stage_rank  # noqa: E402


class _RecordingStage:
    """What a PipelineStage is asked to do, and nothing else."""

    def __init__(self, stage: int, stages: int) -> None:
        self.stage_index, self.num_stages = stage, stages
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.log: list[tuple[int, str, int]] = []

    def get_fwd_recv_ops(self, i: int) -> list[Any]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i: int, *args: Any, **kwargs: Any) -> None:
        self.log.append((self.stage_index, "F", i))

    def backward_one_chunk(self, i: int, **kwargs: Any) -> None:
        self.log.append((self.stage_index, "B", i))

    def perform_reduce_grad(self, *args: Any) -> None:
        pass


def _torch_single(cls: type, stage: int, stages: int, chunks: int) -> list[tuple[int, str, int]]:
    """Run ``cls._step_microbatches`` (torch's code) on a recording stage."""
    schedule = object.__new__(cls)
    schedule._stage, schedule._n_microbatches, schedule._num_stages = _RecordingStage(stage, stages), chunks, stages
    schedule.scale_grads = False
    schedule._check_inputs = lambda *a: ([()] * chunks, [{}] * chunks)
    schedule._initialize_stage = schedule._maybe_compute_loss = lambda *a: None
    schedule._maybe_get_loss = schedule._update_losses = lambda *a: None
    schedule._step_microbatches()
    return list(schedule._stage.log)


def _torch_interleaved(rank: int, ranks: int, local: int, chunks: int) -> list[tuple[int, str, int]]:
    rounds = max(1, chunks // ranks)
    fake = SimpleNamespace(n_local_stages=local, microbatches_per_round=chunks // rounds,
                           pp_group_size=ranks, _n_microbatches=chunks)
    actions = torch_pipelining.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
    forward = torch_pipelining._ComputationType.FORWARD
    return [(a.stage_index, "F" if a.computation_type == forward else "B", a.microbatch_index)
            for a in actions if a is not None]


def _simulated(schedule: str, devices: list[str], chunks: int,
               merge: str = "unwaited") -> dict[str, list[tuple[int, str, int]]]:
    """Each device's forwards and backwards, in the order the simulator ran them (zero-bubble
    halves merged by rule ``merge``): a backward whose micro-batch has a weight-gradient event is
    an I, else a whole B."""
    k = len(devices)
    stages = [StageCost(1.0 + 0.3 * s, 2.0 + 0.7 * (s % 2), 0.0, 0.0, 0, 0, 8, 8, 64,
                        bwd_input_ms=0.8 + 0.5 * (s % 3)) for s in range(k)]
    sim = simulate_stages(stages, chunks=chunks, recompute="except_last", ms_per_byte=0.01,
                          schedule=schedule, devices=devices, merge=merge)
    split = {(e.stage, e.microbatch) for e in sim.timeline if e.phase == "weight"}
    kinds = {"forward": "F", "weight": "W", "backward": "B"}
    out: dict[str, list[tuple[int, str, int]]] = {d: [] for d in devices}
    for e in sorted(sim.timeline, key=lambda e: e.start_ms):
        if e.phase in kinds:
            kind = "I" if e.phase == "backward" and (e.stage, e.microbatch) in split else kinds[e.phase]
            out[devices[e.stage]].append((e.stage, kind, e.microbatch))
    return out


@pytest.mark.parametrize(("name", "cls"), [("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")])
@pytest.mark.parametrize(("stages", "chunks"), [(1, 3), (2, 2), (3, 4), (4, 8), (5, 6)])
def test_single_stage_schedules(name: str, cls: str, stages: int, chunks: int) -> None:
    devices = [f"rank{s}" for s in range(stages)]
    simulated = _simulated(name, devices, chunks)
    for s in range(stages):
        expected = _torch_single(getattr(torch_pipelining, cls), s, stages, chunks)
        assert rank_order(name, s, stages, chunks) == expected
        assert simulated[f"rank{s}"] == expected, (name, stages, chunks, s)


@pytest.mark.parametrize(("ranks", "local", "chunks"),
                         [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (4, 2, 8), (4, 2, 12), (2, 2, 6)])
def test_interleaved_1f1b(ranks: int, local: int, chunks: int) -> None:
    devices = [f"rank{s % ranks}" for s in range(ranks * local)]
    simulated = _simulated("interleaved1f1b", devices, chunks)
    for r in range(ranks):
        expected = _torch_interleaved(r, ranks, local, chunks)
        assert rank_order("interleaved1f1b", r, ranks, chunks, local) == expected
        assert simulated[f"rank{r}"] == expected, (ranks, local, chunks, r)


_ZERO_BUBBLE = {"interleaved_zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                "dualpipev": "ScheduleDualPipeV"}


def _torch_zero_bubble(schedule: str, ranks: int, local: int, chunks: int,
                       merged: str | None = None) -> dict[int, list[tuple[int, str, int]]]:
    """Every rank's compute order of torch's zero-bubble schedule, as it runs it: the class
    constructed on rank 0's fake stages, its lowered ``pipeline_order_with_comms``; ``merged``:
    after the runtime merged its adjacent I and W by that rule (executor/ranks/torch_schedules.py)."""
    k = ranks * local
    fake = [SimpleNamespace(group_size=ranks, group_rank=0, num_stages=k, stage_index=s, submod=None,
                            is_first=s == 0, is_last=s == k - 1)
            for s in range(k) if stage_rank(schedule, s, ranks) == 0]
    torch_schedule = getattr(torch_pipelining, _ZERO_BUBBLE[schedule])(fake, chunks)
    if merged is not None:
        assert merge_adjacent_backward(torch_schedule, schedule, ranks, merged) is None
    kinds = {torch_pipelining._ComputationType.FORWARD: "F", torch_pipelining._ComputationType.FULL_BACKWARD: "B",
             torch_pipelining._ComputationType.BACKWARD_INPUT: "I",
             torch_pipelining._ComputationType.BACKWARD_WEIGHT: "W"}
    out: dict[int, list[tuple[int, str, int]]] = {}
    for rank, actions in torch_schedule.pipeline_order_with_comms.items():
        ops = []
        for action in actions:
            for a in action.sub_actions or (action,):  # OVERLAP_F_B: its forward, then its backward
                if a.computation_type in kinds:
                    ops.append((a.stage_index, kinds[a.computation_type], a.microbatch_index))
        out[rank] = ops
    return out


@pytest.mark.parametrize(("schedule", "ranks", "local", "chunks"), [
    ("interleaved_zb", 2, 2, 2), ("interleaved_zb", 2, 2, 4), ("interleaved_zb", 2, 2, 6),
    ("interleaved_zb", 3, 2, 6), ("interleaved_zb", 4, 2, 8), ("interleaved_zb", 2, 3, 4),
    ("interleaved_zb", 3, 1, 5), ("interleaved_zb", 4, 2, 3),
    ("zbv", 1, 2, 2), ("zbv", 2, 2, 2), ("zbv", 2, 2, 5), ("zbv", 3, 2, 4), ("zbv", 4, 2, 8),
    ("zbv", 4, 2, 12),
    ("dualpipev", 1, 2, 3), ("dualpipev", 2, 2, 4), ("dualpipev", 2, 2, 7), ("dualpipev", 3, 2, 6),
    ("dualpipev", 3, 2, 9), ("dualpipev", 4, 2, 8), ("dualpipev", 4, 2, 16),
])
def test_zero_bubble_schedules(schedule: str, ranks: int, local: int, chunks: int) -> None:
    k = ranks * local
    check_schedule(schedule, k, ranks, chunks)  # what torch accepts, it accepts too
    devices = [f"rank{stage_rank(schedule, s, ranks)}" for s in range(k)]
    expected = _torch_zero_bubble(schedule, ranks, local, chunks)
    for r in range(ranks):
        assert torch_rank_order(schedule, r, ranks, chunks, local) == expected[r], (schedule, ranks, chunks, r)
    for rule in MERGE_RULES:  # [Note: adjacent I and W]
        simulated = _simulated(schedule, devices, chunks, rule)
        run = _torch_zero_bubble(schedule, ranks, local, chunks, merged=rule)  # what the runtime runs
        for r in range(ranks):
            assert run[r] == merged_backward(expected[r], schedule, ranks, rule) == rank_order(
                schedule, r, ranks, chunks, local, rule), (rule, schedule, ranks, chunks, r)
            assert simulated[f"rank{r}"] == run[r], (rule, schedule, ranks, chunks, r)


def test_adjacent_halves_merge_where_no_other_rank_waits_for_the_gradient() -> None:
    # ZB-V on 2 ranks: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
    ops = [(3, "F", 0), (3, "I", 0), (3, "W", 0), (0, "I", 0), (0, "W", 0), (2, "I", 1), (2, "W", 1),
           (1, "I", 2), (1, "W", 2), (0, "I", 1), (2, "W", 0), (0, "W", 1)]
    # stage 3's and stage 1's gradients go to another rank: split; the first stage sends none and
    # stage 2's previous stage shares its rank: merged where their W follows at once
    assert merged_backward(ops, "zbv", 2) == [(3, "F", 0), (3, "I", 0), (3, "W", 0), (0, "B", 0), (2, "B", 1),
                                              (1, "I", 2), (1, "W", 2), (0, "I", 1), (2, "W", 0), (0, "W", 1)]
    assert merged_backward([], "zbv", 2) == [] and merged_backward([(0, "I", 0)], "zbv", 2) == [(0, "I", 0)]
    # interleaved_zb on 2 ranks: stage s on rank s % 2, only the first stage's merge
    assert merged_backward([(2, "I", 0), (2, "W", 0), (0, "I", 0), (0, "W", 0)], "interleaved_zb", 2) == [
        (2, "I", 0), (2, "W", 0), (0, "B", 0)]
    # ZB-V on 2 ranks, M = 8: rank 0's first stage merges all 8, rank 1's stage 2 seven of 8
    for r, whole in ((0, 8), (1, 7)):
        run = rank_order("zbv", r, 2, 8, 2)
        assert sum(kind == "B" for _, kind, _ in run) == whole and sum(kind == "I" for _, kind, _ in run) == 16 - whole


def test_the_adjacent_rule_merges_every_I_its_W_follows_at_once() -> None:
    ops = [(3, "F", 0), (3, "I", 0), (3, "W", 0), (0, "I", 0), (0, "W", 0), (2, "I", 1), (2, "W", 1),
           (1, "I", 2), (1, "W", 2), (0, "I", 1), (2, "W", 0), (0, "W", 1)]
    # stages 3 and 1 send their gradient to the other rank, which now waits for their W too
    assert merged_backward(ops, "zbv", 2, "adjacent") == [(3, "F", 0), (3, "B", 0), (0, "B", 0), (2, "B", 1),
                                                          (1, "B", 2), (0, "I", 1), (2, "W", 0), (0, "W", 1)]
    # a W that does not follow its own I at once (another micro-batch's, or later) stays apart
    assert merged_backward([(1, "I", 0), (1, "W", 1), (1, "I", 1), (2, "W", 1)], "zbv", 2, "adjacent") == [
        (1, "I", 0), (1, "W", 1), (1, "I", 1), (2, "W", 1)]
    for r in range(2):  # ZB-V on 2 ranks, M = 8: more whole than under "unwaited", never fewer
        unwaited, adjacent = rank_order("zbv", r, 2, 8, 2), rank_order("zbv", r, 2, 8, 2, "adjacent")
        assert sum(k == "B" for _, k, _ in adjacent) > sum(k == "B" for _, k, _ in unwaited)
        assert [(s, i) for s, k, i in adjacent if k in "BI"] == [(s, i) for s, k, i in unwaited if k in "BI"]
    with pytest.raises(ValueError, match=r"merge_backward='all': choose one of \['unwaited', 'adjacent'\]"):
        merged_backward(ops, "zbv", 2, "all")
