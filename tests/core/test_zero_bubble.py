"""The zero-bubble schedules in the cost model and the simulator: [Note: split backward], [Note:
split backward time], [Note: stage memory] and [Note: weight gradients and the all-reduce].
Torch's own orders are checked in tests/test_schedule_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.core.corrections import Corrections, Phases, call_fallbacks
from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    StageCost,
    stage_costs,
    stage_terms,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at
from autopipe.core.schedules import rank_order, torch_rank_order
from autopipe.core.simulator import simulate, simulate_stages
from autopipe.core.stage_memory import FIRST_BACKWARD, IN_BACKWARD
from autopipe.errors import PlanError, ProfileError
from autopipe.solvers.synthetic import chain_profile, random_chain
from executor.spec import SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_schedule, stage_rank

V = ["r0", "r1", "r1", "r0"]  # zbv / dualpipev on 2 ranks: rank r holds stages r and 3 - r


def _stage(saved: int = 100, held: int = 0, out: int = 0, inp: int = 0) -> StageCost:
    return StageCost(1.0, 2.0, 0.0, 0.0, 0, 0, inp, out, saved, bwd_input_ms=1.0, weight_held_bytes=held)


def test_schedule_names_and_layout() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved1f1b", *ZERO_BUBBLE_SCHEDULES)
    assert [stage_rank("zbv", s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_rank("interleaved_zb", s, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    check_schedule("zbv", 4, 2, 1)  # torch's ZBV takes any micro-batch count
    check_schedule("interleaved_zb", 3, 3, 5)  # one stage per rank is fine
    with pytest.raises(ValueError, match=r"exactly 2 stages per rank.*2 ranks need 4 stages, not 6"):
        check_schedule("dualpipev", 6, 2, 8)
    with pytest.raises(ValueError, match=r"chunks >= stages \(4\), got chunks=3"):
        check_schedule("dualpipev", 4, 2, 3)
    with pytest.raises(ValueError, match=r"multiple of its rounds.*use chunks=4"):
        check_schedule("interleaved_zb", 4, 2, 5)


def test_a_rank_runs_every_split_backward_once_after_its_forward() -> None:
    for schedule, ranks, chunks in (("interleaved_zb", 3, 6), ("zbv", 3, 4), ("dualpipev", 3, 7)):
        for r in range(ranks):
            ops = rank_order(schedule, r, ranks, chunks, 2)
            for s in {op[0] for op in ops}:
                for i in range(chunks):
                    kinds = [kind for st, kind, mb in ops if (st, mb) == (s, i)]
                    assert kinds in (["F", "B"], ["F", "I", "W"]), (schedule, r, s, i, kinds)


def test_activations_stay_until_w_with_what_w_starts_from() -> None:
    # interleaved_zb, 2 ranks of 1 stage, M = 2: stage 1 runs F0 I0 F1 I1 W0 W1, so both
    # micro-batches' activations and weight-gradient inputs are held after I1
    assert rank_order("interleaved_zb", 1, 2, 2) == [(1, "F", 0), (1, "I", 0), (1, "F", 1), (1, "I", 1),
                                                     (1, "W", 0), (1, "W", 1)]
    assert stage_terms("interleaved_zb", 1, 2, 2, 0) == ((0, 1, 1, 0, IN_BACKWARD), (0, 2, 2, 0, FIRST_BACKWARD))
    # stage 0: torch's F0 F1 I0 W0 I1 W1, run as F0 F1 B0 B1 ([Note: adjacent I and W]): nothing
    # waits for a W
    assert torch_rank_order("interleaved_zb", 0, 2, 2) == [(0, "F", 0), (0, "F", 1), (0, "I", 0), (0, "W", 0),
                                                           (0, "I", 1), (0, "W", 1)]
    assert stage_terms("interleaved_zb", 0, 2, 2, 0) == ((0, 1, 0, 0, IN_BACKWARD), (0, 2, 0, 0, FIRST_BACKWARD))
    sim = simulate_stages([_stage(held=7), _stage(held=10)], chunks=2, recompute="never", ms_per_byte=0.0,
                          schedule="interleaved_zb")
    assert sim.peak_memory == [2 * 100, 2 * 100 + 2 * 10]
    # 1F1B frees each micro-batch at its backward: stage 1 holds one
    one = simulate_stages([_stage(held=7), _stage(held=10)], chunks=2, recompute="never", ms_per_byte=0.0,
                          schedule="1f1b")
    assert one.peak_memory == [200, 100]
    # a checkpointed micro-batch recomputes in I and keeps the recomputed forward until W
    assert stage_terms("interleaved_zb", 1, 2, 2, 2) == ((1, 1, 1, 1, IN_BACKWARD), (2, 2, 2, 2, FIRST_BACKWARD))


def test_split_stage_costs_from_a_profile() -> None:
    prof = chain_profile([1.0] * 4, bwd_input_ms=[0.5, 1.5, 0.5, 1.5], param_bytes=8,
                         output_bytes=64, saved_bytes=32, weight_grad_bytes=[4, 5, 6, 7])
    costs = LayerCosts.from_profile(prof)
    devices = [DeviceSpec(n) for n in V]
    stages = stage_costs(costs, [0, 1, 2, 3], devices, CostOptions(4, "never", schedule="zbv", bandwidth=None))
    # the first stage's I computes nothing, its W the whole backward ([Note: split backward time])
    assert [s.bwd_input_ms for s in stages] == [0.0, 1.5, 0.5, 1.5]
    assert [s.bwd_ms for s in stages] == [2.0] * 4
    # held from I to W: the layers' weight-gradient inputs (none on the first stage) and the
    # received output gradient (none on the last)
    assert [s.weight_held_bytes for s in stages] == [64, 5 + 64, 6 + 64, 7]
    sim = simulate_stages(stages, chunks=4, recompute="never", ms_per_byte=0.0, schedule="zbv", devices=V)
    # rank 0 runs every I with its W at once: the first stage's backward, whole
    first = [(e.phase, round(e.duration_ms, 6)) for e in sim.timeline if e.stage == 0 and e.microbatch == 0]
    assert first == [("forward", 1.0), ("backward", 2.0)]
    # rank 1 runs I1.3 and W1.3 apart
    apart = [(e.phase, round(e.duration_ms, 6)) for e in sim.timeline if e.stage == 1 and e.microbatch == 3]
    assert apart == [("forward", 1.0), ("backward", 1.5), ("weight", 0.5)]
    gpipe = stage_costs(costs, [0, 1, 2, 3], devices[:1] * 4, CostOptions(4, "never", bandwidth=None))
    assert all(s.bwd_input_ms is None and s.weight_held_bytes == 0 for s in gpipe)  # only where split


def test_the_split_costs_what_the_profile_measured_and_two_stages_do_not_split() -> None:
    base = chain_profile([1.0] * 4, bwd_input_ms=[0.5, 1.5, 0.5, 1.5], param_bytes=8,
                         output_bytes=64, saved_bytes=32, weight_grad_bytes=[4, 5, 6, 7])
    prof = Profile.from_frame(base.df, meta={**base.meta, "bwd_split_ratio": 1.25})
    costs = LayerCosts.from_profile(prof)
    assert costs.split_ratio == 1.25 and LayerCosts.from_profile(base).split_ratio == 1.0
    devices = [DeviceSpec(n) for n in V]
    options = CostOptions(4, "never", schedule="zbv", bandwidth=None, recompute_layers=("l1",))
    stages = stage_costs(costs, [0, 1, 2, 3], devices, options)
    # the two halves cost 1.25x the whole on a stage that splits ([Note: split backward time]);
    # the first stage runs its backward whole at the W, the stage of a recomputed layer segment
    # whole at the I (torch's reentrant recompute: executor/ranks/split_backward.py), holding nothing
    parts = [(s.bwd_input_ms, s.bwd_weight_ms) for s in stages]
    assert parts[0] == (0.0, 2.0) and parts[2] == (0.5 * 1.25, 1.5 * 1.25) and parts[3] == (1.5 * 1.25, 0.5 * 1.25)
    assert parts[1][1] == 0.0 and parts[1][0] == pytest.approx(stages[1].bwd_ms) and stages[1].bwd_ms > 2.0
    assert stages[1].weight_held_bytes == 0 and stages[2].weight_held_bytes == 6 + 64
    assert [s.time_ms - s.fwd_ms for s in stages] == pytest.approx([2.0, stages[1].bwd_ms, 2.5, 2.5])
    sim = simulate_stages(stages, chunks=4, recompute="never", ms_per_byte=0.0, schedule="zbv", devices=V)

    def ops(s: int, i: int) -> dict[str, float]:
        return {e.phase: round(e.duration_ms, 6) for e in sim.timeline if (e.stage, e.microbatch) == (s, i)}

    assert ops(3, 0) == {"forward": 1.0, "backward": 1.875, "weight": 0.625}  # its gradient goes to rank 1
    assert ops(1, 3)["weight"] == 0.0  # all of it at the I
    # I2.0 W2.0 side by side, stage 1 on the same rank ([Note: adjacent I and W]): whole, no ratio
    assert ops(2, 0) == {"forward": 1.0, "backward": 2.0}


@pytest.mark.parametrize("schedule", ZERO_BUBBLE_SCHEDULES)
def test_peak_memory_matches_cost_model(schedule: str) -> None:
    prof = random_chain(12, 3, split=True)
    split = [prof.layers[:3], prof.layers[3:5], prof.layers[5:9], prof.layers[9:]]
    devices = V if schedule != "interleaved_zb" else ["r0", "r1", "r0", "r1"]
    for checkpoint in ("always", "except_last", "never", ["always", "never", "except_last", "never"]):
        plan = Plan.from_stages(prof, split, chunks=4, recompute=checkpoint, schedule=schedule, devices=devices)
        assert plan.peak_memory == plan.stage_memory, checkpoint
        sim = simulate(plan, prof)
        assert sim.iteration_time == pytest.approx(plan.iteration_time)
        assert max(sim.device_memory.values()) <= sum(plan.stage_memory)
        assert any(e.phase == "weight" for e in sim.timeline)


def test_the_v_bottom_sends_nothing() -> None:
    stages = [_stage(out=10, inp=0), _stage(out=10, inp=10), _stage(out=10, inp=10), _stage(out=0, inp=10)]

    def sends(schedule: str, devices: list[str]) -> list[int]:  # per stage (receiving is free here)
        sim = simulate_stages(stages, chunks=4, recompute="never", ms_per_byte=0.1, schedule=schedule,
                              devices=devices)
        return [sum(1 for e in sim.timeline if e.stage == s and e.phase == "transfer" and e.duration_ms > 0)
                for s in range(4)]

    # stages 1 and 2 share rank 1: 1 sends only its gradients to 0, 2 only its outputs to 3
    assert sends("zbv", V) == [4, 4, 4, 4]
    assert sends("interleaved_zb", ["r0", "r1", "r0", "r1"]) == [4, 8, 8, 4]


def test_the_all_reduce_starts_after_the_last_weight_gradient() -> None:
    stages = [StageCost(1.0, 2.0, 0.0, 0.0, 0, 0, 0, 0, 10, bwd_input_ms=1.0, grad_sync_ms=3.0) for _ in V]
    sim = simulate_stages(stages, chunks=4, recompute="never", ms_per_byte=0.0, schedule="zbv", devices=V)
    def last_gradient(s: int) -> float:  # its last W, or its last whole backward
        return max(e.end_ms for e in sim.timeline if e.stage == s and e.phase in ("backward", "weight"))

    for s in range(4):
        (sync,) = [e for e in sim.timeline if e.stage == s and e.phase == "allreduce"]
        assert sync.start_ms >= last_gradient(s)
    assert any(e.phase == "weight" for e in sim.timeline if e.stage == 2)  # rank 1 defers some Ws
    # a V rank's later stage ends its gradients first: its all-reduce runs under the other's last
    assert last_gradient(3) < last_gradient(0)


def test_a_profile_without_the_split_plans_everything_else(tmp_path: Path) -> None:
    prof = random_chain(8, 1)
    assert "bwd_input_ms" not in prof.df.columns  # an old or hand-written profile
    prof.save(tmp_path / "old")
    old = Profile.load(tmp_path / "old")
    assert LayerCosts.from_profile(old).bwd_input is None
    with pytest.raises(PlanError, match=r"^profile again: schedule='zbv' splits each backward"):
        simulate_stages([StageCost(1.0, 2.0, 0.0, 0.0, 0, 0, 0, 0, 1)] * 2, chunks=2, recompute="never",
                        ms_per_byte=0.0, schedule="zbv", devices=["a", "a"])
    with pytest.raises(ProfileError, match=r"has \['bwd_input_ms'\] but not"):
        Profile.from_frame(prof.df.assign(bwd_input_ms=1.0))


def test_the_split_saves_loads_and_scales(tmp_path: Path) -> None:
    prof = random_chain(6, 2, split=True)
    prof.meta.update(micro_batch_size=4, batch_size=16, chunks=4)
    prof.save(tmp_path / "p")
    back = Profile.load(tmp_path / "p")
    assert back.df[["bwd_input_ms", "bwd_weight_ms", "weight_grad_bytes"]].equals(
        prof.df[["bwd_input_ms", "bwd_weight_ms", "weight_grad_bytes"]])
    half = profile_at(prof, 2)
    share = prof.df["bwd_input_ms"] / prof.df["bwd_ms"]
    assert (half.df["bwd_input_ms"] / half.df["bwd_ms"]).round(9).equals(share.round(9))
    assert (half.df["bwd_input_ms"] + half.df["bwd_weight_ms"] - half.df["bwd_ms"]).abs().max() < 1e-9
    assert (half.df["weight_grad_bytes"] * 2 - prof.df["weight_grad_bytes"]).abs().max() <= 2


def test_zero_bubble_calls_pay_interleaved_1f1bs() -> None:
    assert call_fallbacks("zbv") == ("zbv", "interleaved1f1b", "1f1b", "gpipe")
    c = Corrections(stage_calls={"distributed": {"gpipe": Phases(0.1, 0.2), "1f1b": Phases(0.3, 0.4),
                                                 "interleaved1f1b": Phases(0.5, 0.6)}})
    assert c.call_for("distributed", "dualpipev") == Phases(0.5, 0.6)
    assert c.call_for("distributed", "interleaved_zb") == Phases(0.5, 0.6)
    assert Corrections(stage_calls={"gpipe": {"gpipe": Phases(0.1, 0.2)}}).call_for("gpipe", "zbv") == Phases(0.1, 0.2)
    # a split backward's two calls share the backward's call cost; a whole one pays it once
    stage = StageCost(1.0, 2.0, 0.0, 0.0, 0, 0, 0, 0, 1, call_bwd_ms=0.4, bwd_input_ms=0.5)
    sim = simulate_stages([stage] * 4, chunks=4, recompute="never", ms_per_byte=0.0, schedule="zbv", devices=V)

    def durations(s: int, i: int) -> list[float]:
        return sorted(round(e.duration_ms, 6) for e in sim.timeline
                      if (e.stage, e.microbatch) == (s, i) and e.phase != "forward")

    assert durations(1, 0) == [0.7, 1.7]  # stage 1's gradient goes to rank 0: split
    assert durations(2, 0) == [2.4]  # I2.0 W2.0 side by side, stage 1 on the same rank: one
    # backward ([Note: adjacent I and W])


def test_a_plan_of_another_schedule_simulates_under_a_zero_bubble_one() -> None:
    prof = random_chain(8, 4, split=True)
    split = [prof.layers[:2], prof.layers[2:4], prof.layers[4:6], prof.layers[6:]]
    plan = Plan.from_stages(prof, split, chunks=4, recompute="never", schedule="interleaved1f1b",
                            devices=["r0", "r1", "r0", "r1"])
    zb = Plan.from_stages(prof, split, chunks=4, recompute="never", schedule="interleaved_zb",
                          devices=["r0", "r1", "r0", "r1"])
    assert simulate(plan, prof, schedule="interleaved_zb").iteration_time == pytest.approx(zb.iteration_time)
    with pytest.raises(PlanError, match=r"^profile again: .*simulate\(plan, profile, schedule=\.\.\.\)"):
        simulate(plan, schedule="interleaved_zb")  # the plan's own costs have no split


def test_the_plan_keeps_the_faster_merge_rule() -> None:
    """[Note: adjacent I and W]: merging a pair whose gradient another rank waits for delays that
    rank; splitting it costs the profile's split ratio. The plan simulates both rules."""
    base = chain_profile([1.0] * 4, bwd_input_ms=[0.5, 1.5, 0.5, 1.5], param_bytes=8,
                         output_bytes=64, saved_bytes=32, weight_grad_bytes=[4, 5, 6, 7])
    stages = [[name] for name in base.layers]
    for ratio, faster in ((1.0, "unwaited"), (1.25, "adjacent")):
        prof = Profile.from_frame(base.df, meta={**base.meta, "bwd_split_ratio": ratio})

        def plan(rule: str | None, prof: Profile = prof) -> Plan:
            return Plan.from_stages(prof, stages, chunks=8, recompute="never", schedule="zbv", devices=V,
                                    bandwidth=None, merge_backward=rule)

        each = {rule: plan(rule).iteration_time for rule in ("unwaited", "adjacent")}
        chosen = plan(None)
        assert chosen.merge_backward == faster and chosen.iteration_time == min(each.values()), (ratio, each)
        assert each["unwaited"] != each["adjacent"]
        assert simulate(chosen, prof).iteration_time == pytest.approx(chosen.iteration_time)  # the plan's rule
        assert f"(merge_backward {faster!r})" in chosen.explain()
        again = Plan.from_dict(chosen.to_dict())
        assert again.merge_backward == faster and again.cost_options.merge == faster
    # other schedules have no halves to merge; a plan saved before the field loads as "unwaited"
    assert Plan.from_stages(base, stages, chunks=8, schedule="1f1b").merge_backward == "unwaited"
    old = {k: v for k, v in chosen.to_dict().items() if k != "merge_backward"}
    assert Plan.from_dict(old).merge_backward == "unwaited"
    with pytest.raises(PlanError, match=r"plan has a malformed field: 'merge_backward' must be one of "
                                        r"\['unwaited', 'adjacent'\], got 'all'"):
        Plan.from_dict({**old, "merge_backward": "all"})
    with pytest.raises(PlanError, match=r"merge_backward='all': choose one of"):
        simulate_stages(chosen.breakdown, chunks=8, recompute="never", ms_per_byte=0.0, schedule="zbv",
                        devices=V, merge="all")
