"""The simulator runs each rank's forwards and backwards in torch.distributed.pipelining's order.

[Note: schedule orders] (autopipe/core/schedules.py) writes torch's ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B orders out torch-free. Here torch's own code decides:
the single-stage schedules run their real ``_step_microbatches`` against a stage that only
records what it is asked to compute (no process group, no tensors), and the interleaved one is
asked for its per-rank actions. The simulator's timeline must execute exactly that order on
every rank, for stages of uneven cost.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch_pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

from autopipe.core.cost import StageCost  # noqa: E402
from autopipe.core.schedules import rank_order  # noqa: E402
from autopipe.core.simulator import simulate_stages  # noqa: E402


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


def _simulated(schedule: str, devices: list[str], chunks: int) -> dict[str, list[tuple[int, str, int]]]:
    """Each device's forwards and backwards, in the order the simulator ran them."""
    k = len(devices)
    stages = [StageCost(1.0 + 0.3 * s, 2.0 + 0.7 * (s % 2), 0.0, 0.0, 0, 0, 8, 8, 64) for s in range(k)]
    sim = simulate_stages(stages, chunks=chunks, checkpoint="except_last", ms_per_byte=0.01,
                          schedule=schedule, devices=devices)
    out: dict[str, list[tuple[int, str, int]]] = {d: [] for d in devices}
    for e in sorted(sim.timeline, key=lambda e: e.start_ms):
        if e.phase in ("forward", "backward"):
            out[devices[e.stage]].append((e.stage, e.phase[0].upper(), e.microbatch))
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
