"""[Note: recomputed layers]: what a layer recomputed alone frees and costs, in every cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.cost import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.recomputed_layers import (
    choose_segments,
    recompute_peak,
    segment_freed,
    segment_outputs,
    segments,
)
from autopipe.errors import PartitionError, PlanError
from autopipe.solvers.synthetic import transformer_dag

STAGES = 2


def _dag() -> Profile:
    prof = transformer_dag(2, hidden_bytes=1 << 20)
    return Profile(prof.df, prof.edges, {**prof.meta, "recompute_ratio": 1.2, "recompute_call_ms": 0.1})


def _split(prof: Profile) -> list[list[str]]:
    half = len(prof.layers) // 2
    return [prof.layers[:half], prof.layers[half:]]


def test_a_segment_frees_its_saves_less_a_copy_of_what_enters_it() -> None:
    costs = LayerCosts.from_profile(_dag())
    i = costs.names.index("h0.attn")  # saves 4 x hidden, reads ln1's hidden
    assert costs.saved[i] == 4 << 20 and costs.resaved[i] == 0
    assert segment_freed(costs, [i]) == 3 << 20
    j = costs.names.index("h0.ln1")  # saves what it reads: alone it frees nothing
    assert segment_freed(costs, [j]) == 0
    # ln1 -> attn -> proj as one segment: one copy of ln1's input for all their saves
    run = [j, j + 1, j + 2]
    entering = costs.value_bytes[costs.names.index("embed")]
    assert segment_freed(costs, run) == int(costs.saved[run].sum()) - entering
    assert segment_freed(costs, run) > sum(segment_freed(costs, [k]) for k in run)
    assert segments([5, 3, 4, 9, 10], [0] * 10 + [1]) == [[3, 4, 5], [9], [10]]  # 10: next stage


def test_the_checkpoint_holds_a_segments_outputs_and_their_gradients_in_its_backward() -> None:
    # torch's CheckpointFunction.backward keeps what it recomputed as the segment's outputs, and
    # their gradients, until it returns; an output a layer of the segment saves is a save already
    prof = _dag()
    df = prof.df.copy()
    df["saved_input_bytes"] = [1 << 20 if n == "h0.ln2" else 0 for n in df["layer"]]  # ln2 saves add1's output
    costs = LayerCosts.from_profile(Profile(df, prof.edges, prof.meta))
    at = costs.names.index
    mb = 1 << 20
    assert segment_outputs(costs, [at("h0.attn"), at("h0.proj")]) == 2 * mb  # proj's output and its gradient
    # add1's output is read by ln2 (inside, which saves it) and by add2 (outside): its gradient only
    assert segment_outputs(costs, [at("h0.add1"), at("h0.ln2")]) == mb + 2 * mb
    assert segment_outputs(costs, [at("h0.ln2"), at("h0.fc1"), at("h0.fc2")]) == 2 * mb
    # the stage's peak: the largest segment with its outputs, on top of the largest without them
    runs = [[at("h0.attn")], [at("h0.ln2"), at("h0.fc1"), at("h0.fc2")]]
    again, outputs = recompute_peak(costs, runs, [])
    assert again == max(int(costs.saved[r].sum()) for r in runs) == 9 * mb
    assert again + outputs == max(int(costs.saved[r].sum()) + segment_outputs(costs, r) for r in runs) == 11 * mb
    plan = Plan.from_stages(prof, _split(prof), chunks=4, recompute="never", recompute_layers=["h0.attn"])
    assert plan.breakdown[0].recompute_outputs_bytes == segment_outputs(LayerCosts.from_profile(prof), [at("h0.attn")]) == 2 * mb


def test_the_stage_keeps_less_and_its_backward_recomputes() -> None:
    prof = _dag()
    split = _split(prof)
    assert {"h0.attn", "h0.fc1"} <= set(split[0])
    plain = Plan.from_stages(prof, split, chunks=4, recompute="never")
    chosen = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=["h0.fc1", "h0.attn"])
    costs = LayerCosts.from_profile(prof)
    picked = [costs.names.index(n) for n in ("h0.attn", "h0.fc1")]  # two segments of one layer
    assert chosen.recompute_layers == ["h0.attn", "h0.fc1"]  # in the profile's order
    assert plain.breakdown[0].saved_bytes - chosen.breakdown[0].saved_bytes == sum(
        segment_freed(costs, [i]) for i in picked)
    assert chosen.breakdown[0].bwd_ms - plain.breakdown[0].bwd_ms == pytest.approx(
        sum(costs.fwd[i] * 1.2 + 0.1 for i in picked))
    assert chosen.breakdown[0].activation_bytes < plain.breakdown[0].activation_bytes
    assert chosen.breakdown[1] == plain.breakdown[1]
    assert chosen.iteration_time > plain.iteration_time  # memory is bought with time


def test_a_plan_keeps_its_recomputed_layers_and_older_plans_have_none(tmp_path: Path) -> None:
    prof = _dag()
    plan = Plan.from_stages(prof, _split(prof), chunks=4, recompute="never", recompute_layers=["h0.attn"])
    path = plan.save(tmp_path / "p.json")
    loaded = Plan.load(path)
    assert loaded.recompute_layers == ["h0.attn"] and loaded.cost_options.recompute_layers == ("h0.attn",)
    data = json.loads(path.read_text())
    del data["recompute_layers"]
    assert Plan.from_dict(data).recompute_layers == []
    data["recompute_layers"] = ["no.such.layer"]
    with pytest.raises(PlanError, match="'recompute_layers' must list layers of stages whose recompute is 'never'"):
        Plan.from_dict(data)


def test_only_stages_that_never_recompute_as_a_whole_take_them() -> None:
    prof = _dag()
    with pytest.raises(PartitionError, match="stage 0 recomputes as a whole .recompute 'always'."):
        Plan.from_stages(prof, _split(prof), chunks=4, recompute=["always", "never"],
                         recompute_layers=[_split(prof)[0][1]])
    with pytest.raises(PartitionError, match="'nope', which is not a layer of the profile"):
        Plan.from_stages(prof, _split(prof), chunks=4, recompute="never", recompute_layers=["nope"])


def _brute_force(costs: LayerCosts, layers: list[int], need: int) -> float:
    """The least added time of any choice of layers whose segments free ``need`` bytes."""
    import itertools

    best = float("inf")
    for r in range(len(layers) + 1):
        for combo in itertools.combinations(layers, r):
            runs = segments(list(combo), [0] * len(costs))
            if sum(segment_freed(costs, run) for run in runs) >= need:
                best = min(best, sum(float(costs.fwd[run].sum()) * 1.2 + 0.1 for run in runs))
    return best


def test_choose_frees_enough_at_about_the_least_time() -> None:
    costs = LayerCosts.from_profile(_dag())
    stage = list(range(2, 12))  # h0.ln1 .. h1.ln2: ten layers, 2**10 choices
    assert choose_segments(costs, stage, 0) == []
    for need in (1 << 20, 3 << 20, 6 << 20, 12 << 20):
        runs = choose_segments(costs, stage, need)  # each apart, as the plan keeps them
        assert sum(segment_freed(costs, run) for run in runs) >= need
        spent = sum(float(costs.fwd[run].sum()) * 1.2 + 0.1 for run in runs)
        assert spent <= _brute_force(costs, stage, need) * 1.25  # the Lagrangian DP: near the optimum
    everything = choose_segments(costs, stage, 1 << 40)  # more than any choice frees: the most it can
    assert sum(segment_freed(costs, run) for run in everything) >= max(
        segment_freed(costs, list(range(a, b))) for a in stage for b in range(a + 1, stage[-1] + 2))


def test_the_choosers_running_sums_agree_with_segment_freed() -> None:
    # the chooser sums each interval's bytes as it grows; stage_costs asks segment_freed: one rule
    from autopipe.core.recomputed_layers import _intervals

    costs = LayerCosts.from_profile(_dag())
    layers = list(range(len(costs)))
    starts, ends, freed, _ = _intervals(costs, layers)
    assert freed.size
    for a, b, f in zip(starts, ends, freed, strict=True):
        assert f == segment_freed(costs, layers[a:b + 1])
    listed = set(zip(starts.tolist(), ends.tolist(), strict=True))
    assert all(segment_freed(costs, layers[a:b + 1]) == 0 for a in layers for b in range(a, len(layers))
               if (a, b) not in listed and b - a < 64)


def test_last_saver_is_made_once_and_read_only() -> None:
    """Read one layer at a time in loops over every layer (_intervals, segment_freed): made
    anew at each read it made the chooser quadratic (100 s for a 1,924-layer profile)."""
    costs = LayerCosts.from_profile(_dag())
    saver = costs.last_saver
    assert saver is costs.last_saver and not saver.flags.writeable
    assert list(saver) == list(range(len(costs)))  # no reader saves what it reads here: each itself


def _blocks_of(prof: Profile, *blocks: int) -> list[str]:
    return [n for b in blocks for n in prof.layers if n.startswith(f"h{b}.")]


def test_segment_starts_keep_consecutive_layers_apart() -> None:
    assert segments([3, 4, 5, 6], [0] * 10, {5}) == [[3, 4], [5, 6]]
    assert segments([3, 4, 5, 6], [0] * 10, {3}) == [[3, 4, 5, 6]]  # a run's own first: no change
    assert segments([3, 4, 5, 6], [0] * 10) == [[3, 4, 5, 6]]


def test_adjacent_segments_kept_apart_are_alive_again_one_at_a_time() -> None:
    # two whole blocks recomputed, merged: both blocks' saves alive again at once in the backward;
    # apart: one block's at a time, one more checkpoint call
    prof = _dag()
    split = [["embed", *_blocks_of(prof, 0, 1)], ["head"]]
    chosen = _blocks_of(prof, 0, 1)
    merged = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=chosen)
    apart = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=chosen,
                             segment_starts=["h1.ln1"])
    costs = LayerCosts.from_profile(prof)
    block_saves = [sum(int(costs.saved[costs.names.index(n)]) for n in _blocks_of(prof, b)) for b in (0, 1)]
    assert merged.breakdown[0].recompute_bytes == sum(block_saves)  # nothing kept after them in stage 0
    assert apart.breakdown[0].recompute_bytes == max(block_saves) < sum(block_saves)
    assert [b.recompute_segments for b in apart.breakdown] == [2, 0]
    assert [b.recompute_segments for b in merged.breakdown] == [1, 0]
    assert apart.breakdown[0].bwd_ms - merged.breakdown[0].bwd_ms == pytest.approx(0.1)  # one more call
    # apart, each segment keeps a copy of what enters it: block 1's input, on top of block 0's
    h = costs.value_bytes[costs.names.index("h0.add2")]
    assert apart.breakdown[0].saved_bytes - merged.breakdown[0].saved_bytes == h
    assert "2 segments recomputed alone" in apart.explain()
    assert "in 2 segment(s)" in apart.table()


def test_segment_starts_survive_json_and_older_plans_merge(tmp_path: Path) -> None:
    prof = _dag()
    split = [["embed", *_blocks_of(prof, 0, 1)], ["head"]]
    chosen = _blocks_of(prof, 0, 1)
    apart = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=chosen,
                             segment_starts=["h1.ln1", "h0.ln1"])
    assert apart.segment_starts == ["h0.ln1", "h1.ln1"]  # in the profile's order
    loaded = Plan.load(apart.save(tmp_path / "p.json"))
    assert loaded == apart and loaded.cost_options.segment_starts == ("h0.ln1", "h1.ln1")
    data = json.loads((tmp_path / "p.json").read_text())
    del data["segment_starts"]
    for b in data["breakdown"]:
        del b["recompute_segments"]
    older = Plan.from_dict(data)  # a plan saved before the field: its layers as one segment
    assert older.segment_starts == [] and older.cost_options.segment_starts == ()
    merged = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=chosen)
    assert older.cost_options == merged.cost_options
    data["segment_starts"] = ["head"]
    with pytest.raises(PlanError, match=r"'segment_starts' must list layers of 'recompute_layers'"):
        Plan.from_dict(data)
    data["segment_starts"] = "h1.ln1"
    with pytest.raises(PlanError, match=r"'segment_starts' must list layers of 'recompute_layers'"):
        Plan.from_dict(data)


def test_a_segment_start_that_is_not_recomputed_is_refused_in_one_line() -> None:
    prof = _dag()
    with pytest.raises(PartitionError, match=r"^segment_starts names 'h0.fc1', which is not among recompute_layers; "
                                             r"name only recomputed layers, each the first of its segment$"):
        Plan.from_stages(prof, _split(prof), chunks=4, recompute="never", recompute_layers=["h0.attn"],
                         segment_starts=["h0.fc1"])
    with pytest.raises(PartitionError, match=r"segment_starts names 'nope'"):
        Plan.from_stages(prof, _split(prof), chunks=4, recompute="never", recompute_layers=["h0.attn"],
                         segment_starts=["nope"])


def test_the_chooser_keeps_adjacent_intervals_apart_as_it_weighed_them() -> None:
    # the chooser weighs each interval with its own copy and its own call: a plan of its choice
    # charges exactly those intervals, apart even where two touch
    prof = _dag()
    costs = LayerCosts.from_profile(prof)
    stage = list(range(1, len(costs) - 1))
    runs = choose_segments(costs, stage, 26 << 20)
    assert any(a[-1] + 1 == b[0] for a, b in zip(runs, runs[1:], strict=False)), runs  # two that touch
    split = [prof.layers[:-1], prof.layers[-1:]]
    names = [costs.names[i] for r in runs for i in r]
    plain = Plan.from_stages(prof, split, chunks=4, recompute="never")
    apart = Plan.from_stages(prof, split, chunks=4, recompute="never", recompute_layers=names,
                             segment_starts=[costs.names[r[0]] for r in runs])
    freed = sum(segment_freed(costs, r) for r in runs)
    assert freed >= 26 << 20
    assert plain.breakdown[0].saved_bytes - apart.breakdown[0].saved_bytes == freed
    assert apart.breakdown[0].recompute_segments == len(runs)


def test_the_chooser_never_cuts_a_tp_group() -> None:
    # the runtime refuses a segment whose edge carries a group's split values
    # (autopipe/assemble/tensor_parallel.check_cuts): attn -> proj and fc1 -> fc2 are groups here
    prof = _dag()
    roles = {"attn": "column", "proj": "row", "fc1": "column", "fc2": "row"}
    prof.df["tp_role"] = [roles.get(n.split(".")[-1], "replicated") for n in prof.layers]
    prof.df["tp_group"] = [f"g:{n.split('.')[0]}.{'a' if n.endswith(('attn', 'proj')) else 'm'}"
                           if n.split(".")[-1] in roles else "" for n in prof.layers]
    prof.df["tp_divides"] = 8
    costs = LayerCosts.from_profile(Profile(prof.df, prof.edges, {**prof.meta, "tensor_parallel": 2}))
    groups = [set(g) for g in costs.tp_groups]
    assert len(groups) == 4
    stage = list(range(1, len(costs) - 1))
    untied = LayerCosts.from_profile(prof)
    cut = [r for need in range(1, 40) for r in choose_segments(untied, stage, need << 20)
           if any(0 < len(g & set(r)) < len(g) for g in groups)]
    assert cut, "without the groups the chooser would cut one: the test would prove nothing"
    for need in range(1, 40):
        for run in choose_segments(costs, stage, need << 20):
            assert all(not g & set(run) or g <= set(run) for g in groups), (need, run)
