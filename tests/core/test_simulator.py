from __future__ import annotations

import pytest

from autopipe.core.cost import StageCost
from autopipe.core.plan import Plan
from autopipe.core.simulator import TimelineEvent, simulate, simulate_stages
from autopipe.errors import PlanError
from autopipe.solvers.synthetic import random_chain


def _stage(f: float = 1.0, b: float = 2.0, inp: int = 0, out: int = 0, saved: int = 10,
           act: int = 0, params: int = 0) -> StageCost:
    return StageCost(f, b, 0.0, 0.0, params, act, inp, out, saved)


def _events(result, stage: int) -> list[tuple[str, int, float, float]]:  # type: ignore[no-untyped-def]
    return [(e.phase, e.microbatch, e.start_ms, e.end_ms) for e in result.timeline if e.stage == stage]


def test_gpipe_k2_m2_with_transfers() -> None:
    # 1 byte = 0.5 ms; stage 0 sends 1 byte forward, stage 1 sends its 1-byte input gradient back
    stages = [_stage(out=1), _stage(inp=1)]
    r = simulate_stages(stages, chunks=2, recompute="never", ms_per_byte=0.5)
    # ScheduleGPipe's order: all forwards, then the backwards in the same order, B0 first
    assert _events(r, 0) == [
        ("forward", 0, 0.0, 1.0), ("transfer", 0, 1.0, 1.5), ("forward", 1, 1.5, 2.5),
        ("transfer", 1, 2.5, 3.0), ("backward", 0, 6.5, 8.5), ("backward", 1, 9.0, 11.0),
    ]
    assert _events(r, 1) == [
        ("forward", 0, 1.5, 2.5), ("forward", 1, 3.0, 4.0), ("backward", 0, 4.0, 6.0),
        ("transfer", 0, 6.0, 6.5), ("backward", 1, 6.5, 8.5), ("transfer", 1, 8.5, 9.0),
    ]
    assert r.iteration_time == 11.0
    busy = 2 * (1 + 2) * 2 + 4 * 0.5
    assert r.bubble_fraction == pytest.approx(1 - busy / (2 * 11.0))


def test_gpipe_k2_m2_recompute_always() -> None:
    r = simulate_stages([_stage(), _stage()], chunks=2, recompute="always", ms_per_byte=0.0)
    assert _events(r, 1) == [
        ("forward", 0, 1.0, 2.0), ("forward", 1, 2.0, 3.0), ("recompute", 0, 3.0, 4.0),
        ("backward", 0, 4.0, 6.0), ("recompute", 1, 6.0, 7.0), ("backward", 1, 7.0, 9.0),
    ]
    assert _events(r, 0)[-2:] == [("recompute", 1, 9.0, 10.0), ("backward", 1, 10.0, 12.0)]
    assert r.iteration_time == 12.0


def test_gpipe_k3_m4() -> None:
    r = simulate_stages([_stage(act=40)] * 3, chunks=4, recompute="never", ms_per_byte=0.0)
    for s in range(3):
        fwd = [(e.start_ms, e.end_ms) for e in r.timeline if e.stage == s and e.phase == "forward"]
        assert fwd == [(s + m, s + m + 1.0) for m in range(4)]
    assert _events(r, 0)[4:] == [("backward", m, 10.0 + 2 * m, 12.0 + 2 * m) for m in range(4)]
    assert _events(r, 2)[4] == ("backward", 0, 6.0, 8.0)
    assert r.iteration_time == 18.0  # (M + K - 1) x (f + b)
    assert r.bubble_fraction == pytest.approx(1 / 3)
    assert r.peak_memory == [40, 40, 40]  # all 4 micro-batches' saved bytes


def test_1f1b_k3_m4() -> None:
    r = simulate_stages([_stage()] * 3, chunks=4, recompute="never", ms_per_byte=0.0, schedule="1f1b")
    assert _events(r, 0) == [
        ("forward", 0, 0.0, 1.0), ("forward", 1, 1.0, 2.0), ("forward", 2, 2.0, 3.0),
        ("backward", 0, 7.0, 9.0), ("forward", 3, 9.0, 10.0), ("backward", 1, 10.0, 12.0),
        ("backward", 2, 13.0, 15.0), ("backward", 3, 16.0, 18.0),
    ]
    assert _events(r, 1) == [
        ("forward", 0, 1.0, 2.0), ("forward", 1, 2.0, 3.0), ("backward", 0, 5.0, 7.0),
        ("forward", 2, 7.0, 8.0), ("backward", 1, 8.0, 10.0), ("forward", 3, 10.0, 11.0),
        ("backward", 2, 11.0, 13.0), ("backward", 3, 14.0, 16.0),
    ]
    assert _events(r, 2)[-2:] == [("forward", 3, 11.0, 12.0), ("backward", 3, 12.0, 14.0)]
    assert r.iteration_time == 18.0
    # 1F1B keeps at most K - s micro-batches in flight: 3, 2, 1 x 10 saved bytes
    assert r.peak_memory == [30, 20, 10]
    gpipe = simulate_stages([_stage()] * 3, chunks=4, recompute="never", ms_per_byte=0.0)
    assert gpipe.peak_memory == [40, 40, 40]


def test_interleaved_two_ranks_exact() -> None:
    # stages 0, 2 on rank a and 1, 3 on rank b, in torch's ScheduleInterleaved1F1B order:
    # a: F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1   b: F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1
    r = simulate_stages([_stage()] * 4, chunks=2, recompute="never", ms_per_byte=0.0,
                        schedule="interleaved1f1b", devices=["a", "b", "a", "b"])
    ops = {s: [(p, i, t0, t1) for p, i, t0, t1 in _events(r, s)] for s in range(4)}
    assert ops[0] == [("forward", 0, 0.0, 1.0), ("forward", 1, 1.0, 2.0),
                      ("backward", 0, 11.0, 13.0), ("backward", 1, 13.0, 15.0)]
    assert ops[1] == [("forward", 0, 1.0, 2.0), ("forward", 1, 2.0, 3.0),
                      ("backward", 0, 9.0, 11.0), ("backward", 1, 11.0, 13.0)]
    assert ops[2] == [("forward", 0, 2.0, 3.0), ("forward", 1, 3.0, 4.0),
                      ("backward", 0, 6.0, 8.0), ("backward", 1, 9.0, 11.0)]
    assert ops[3] == [("forward", 0, 3.0, 4.0), ("backward", 0, 4.0, 6.0),
                      ("forward", 1, 6.0, 7.0), ("backward", 1, 7.0, 9.0)]
    assert r.iteration_time == 15.0
    assert r.bubble_fraction == pytest.approx(1 - 24 / (2 * 15.0))  # 2 ranks, not 4 stages
    # rank a holds both micro-batches of both stages at once; rank b at most three
    assert r.peak_memory == [20, 20, 20, 10] and r.device_memory == {"a": 40, "b": 30}
    with pytest.raises(PlanError, match="stage s on rank s % ranks"):
        simulate_stages([_stage()] * 4, chunks=2, recompute="never", ms_per_byte=0.0,
                        schedule="interleaved1f1b", devices=["a", "a", "b", "b"])


@pytest.mark.parametrize("runtime", ["gpipe", "distributed"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_peak_memory_matches_cost_model(schedule: str, runtime: str) -> None:
    # on ranks too: the receive buffers, kept outputs and (a profile without working sets) no
    # input gradient in flight ([Note: receive buffers] in autopipe/core/stage_memory.py)
    prof = random_chain(12, 3)
    split = [prof.layers[:3], prof.layers[3:5], prof.layers[5:9], prof.layers[9:]]
    devices = ["r0", "r1", "r0", "r1"] if schedule == "interleaved1f1b" else None
    for checkpoint in ("always", "except_last", "never", ["always", "never", "except_last", "never"]):
        plan = Plan.from_stages(prof, split, chunks=4, recompute=checkpoint, schedule=schedule,
                                devices=devices, runtime=runtime)
        assert plan.peak_memory == plan.stage_memory, checkpoint
        sim = simulate(plan, prof)
        assert sim.iteration_time == pytest.approx(plan.iteration_time)
        assert max(sim.device_memory.values()) <= sum(plan.stage_memory)


def test_per_stage_recomputation_in_the_timeline() -> None:
    r = simulate_stages([_stage(), _stage()], chunks=2, recompute=["always", "never"],
                        ms_per_byte=0.0)
    assert {e.stage for e in r.timeline if e.phase == "recompute"} == {0}
    with pytest.raises(PlanError, match=r"recompute lists 1 mode\(s\) for 2 stage\(s\)"):
        simulate_stages([_stage(), _stage()], chunks=2, recompute=["always"], ms_per_byte=0.0)


def test_simulate_plan_with_and_without_profile() -> None:
    prof = random_chain(8, 1)
    plan = Plan.from_stages(prof, [prof.layers[:4], prof.layers[4:]], chunks=3)
    a, b = simulate(plan), simulate(plan, prof)
    assert a.iteration_time == pytest.approx(b.iteration_time) == pytest.approx(plan.iteration_time)
    assert isinstance(a.timeline[0], TimelineEvent)
    assert "stage 1" in a.summary()
    never = Plan.from_stages(prof, plan.stages, chunks=3, recompute="never")
    f1b, gpipe = simulate(never, prof, schedule="1f1b"), simulate(never, prof)
    assert all(a < b for a, b in zip(f1b.peak_memory, gpipe.peak_memory, strict=True))
    with pytest.raises(PlanError, match="schedule='zigzag'"):
        simulate(plan, schedule="zigzag")
    with pytest.raises(PlanError, match="not in the graph"):
        simulate(plan, random_chain(8, 1).__class__.from_frame(prof.df.assign(layer=[f"x{i}" for i in range(8)])))


def test_stages_on_one_device_take_turns() -> None:
    # two stages on one CPU (executor.GPipe with devices=["cpu", "cpu"]): nothing overlaps, so
    # the iteration is all the work in sequence, in fill-drain clock order
    r = simulate_stages([_stage(), _stage()], chunks=2, recompute="never", ms_per_byte=0.0,
                        devices=["cpu", "cpu"])
    order = [(e.stage, e.phase[0], e.microbatch, e.start_ms, e.end_ms) for e in r.timeline]
    assert order == [
        (0, "f", 0, 0.0, 1.0), (0, "f", 1, 1.0, 2.0), (1, "f", 0, 2.0, 3.0),
        (1, "f", 1, 3.0, 4.0), (1, "b", 0, 4.0, 6.0), (1, "b", 1, 6.0, 8.0),
        (0, "b", 0, 8.0, 10.0), (0, "b", 1, 10.0, 12.0),
    ]
    assert r.iteration_time == 12.0  # 2 stages x 2 micro-batches x (1 + 2) ms
    # the same stages on two devices overlap: (M + K - 1) x (f + b)
    apart = simulate_stages([_stage(), _stage()], chunks=2, recompute="never", ms_per_byte=0.0,
                            devices=["cuda:0", "cuda:1"])
    assert apart.iteration_time == 9.0
    with pytest.raises(PlanError, match="1 devices for 2 stages"):
        simulate_stages([_stage(), _stage()], chunks=2, recompute="never", ms_per_byte=0.0,
                        devices=["cpu"])


@pytest.mark.parametrize("runtime", ["gpipe", "distributed"])
def test_the_simulated_peak_has_the_recomputed_segments_saves_again(runtime: str) -> None:
    # [Note: recomputed layers]: a segment recomputed alone at the end of a stage has its saves
    # alive again in its backward; the simulator's peak was its stage's without them
    prof = random_chain(12, 3)
    layers = prof.layers
    plan = Plan.from_stages(prof, [layers[:6], layers[6:]], chunks=4, recompute="never", schedule="1f1b",
                            bandwidth=None, runtime=runtime, recompute_layers=layers[3:6])
    assert plan.breakdown[0].recompute_bytes > 0 and plan.breakdown[0].recompute_outputs_bytes > 0
    assert plan.peak_memory == plan.stage_memory
