"""[Note: recomputed layers]: what a layer recomputed alone frees and costs, in every cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.cost import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.recomputed_layers import choose, extra_ms, freed_bytes
from autopipe.errors import PartitionError, PlanError
from autopipe.solvers.synthetic import transformer_dag

STAGES = 2


def _dag() -> Profile:
    prof = transformer_dag(2, hidden_bytes=1 << 20)
    return Profile(prof.df, prof.edges, {**prof.meta, "recompute_ratio": 1.2, "recompute_call_ms": 0.1})


def _split(prof: Profile) -> list[list[str]]:
    half = len(prof.layers) // 2
    return [prof.layers[:half], prof.layers[half:]]


def test_a_layer_frees_its_saves_less_its_inputs_and_pays_its_forward_again() -> None:
    costs = LayerCosts.from_profile(_dag())
    i = costs.names.index("h0.attn")  # saves 4 x hidden, reads ln1's hidden
    assert costs.saved[i] == 4 << 20 and costs.inputs[i] == 1 << 20 and costs.resaved[i] == 0
    assert freed_bytes(costs)[i] == 3 << 20
    assert extra_ms(costs)[i] == pytest.approx(costs.fwd[i] * 1.2 + 0.1)
    j = costs.names.index("h0.ln1")  # saves what it reads: frees nothing
    assert freed_bytes(costs)[j] == 0


def test_the_stage_keeps_less_and_its_backward_recomputes() -> None:
    prof = _dag()
    split = _split(prof)
    assert {"h0.attn", "h0.fc1"} <= set(split[0])
    plain = Plan.from_stages(prof, split, chunks=4, checkpoint="never")
    chosen = Plan.from_stages(prof, split, chunks=4, checkpoint="never", recompute_layers=["h0.fc1", "h0.attn"])
    costs = LayerCosts.from_profile(prof)
    picked = [costs.names.index(n) for n in ("h0.attn", "h0.fc1")]
    assert chosen.recompute_layers == ["h0.attn", "h0.fc1"]  # in the profile's order
    assert plain.breakdown[0].saved_bytes - chosen.breakdown[0].saved_bytes == int(freed_bytes(costs)[picked].sum())
    assert chosen.breakdown[0].bwd_ms - plain.breakdown[0].bwd_ms == pytest.approx(
        sum(costs.fwd[i] * 1.2 + 0.1 for i in picked))
    assert chosen.breakdown[0].activation_bytes < plain.breakdown[0].activation_bytes
    assert chosen.breakdown[1] == plain.breakdown[1]
    assert chosen.iteration_time > plain.iteration_time  # memory is bought with time


def test_a_plan_keeps_its_recomputed_layers_and_older_plans_have_none(tmp_path: Path) -> None:
    prof = _dag()
    plan = Plan.from_stages(prof, _split(prof), chunks=4, checkpoint="never", recompute_layers=["h0.attn"])
    path = plan.save(tmp_path / "p.json")
    loaded = Plan.load(path)
    assert loaded.recompute_layers == ["h0.attn"] and loaded.cost_options.recompute_layers == ("h0.attn",)
    data = json.loads(path.read_text())
    del data["recompute_layers"]
    assert Plan.from_dict(data).recompute_layers == []
    data["recompute_layers"] = ["no.such.layer"]
    with pytest.raises(PlanError, match="'recompute_layers' must list layers of stages whose checkpoint is 'never'"):
        Plan.from_dict(data)


def test_only_stages_that_never_recompute_as_a_whole_take_them() -> None:
    prof = _dag()
    with pytest.raises(PartitionError, match="stage 0 recomputes as a whole .checkpoint 'always'."):
        Plan.from_stages(prof, _split(prof), chunks=4, checkpoint=["always", "never"],
                         recompute_layers=[_split(prof)[0][1]])
    with pytest.raises(PartitionError, match="'nope', which is not a layer of the profile"):
        Plan.from_stages(prof, _split(prof), chunks=4, checkpoint="never", recompute_layers=["nope"])


def test_choose_takes_the_most_bytes_per_ms_first_until_enough() -> None:
    costs = LayerCosts.from_profile(_dag())
    stage = list(range(len(costs)))
    freed, cost = freed_bytes(costs), extra_ms(costs)
    assert choose(costs, stage, 0) == []
    one = choose(costs, stage, 1)
    best = max((i for i in stage if freed[i] > 0), key=lambda i: freed[i] / cost[i])
    assert one == [best]
    everything = choose(costs, stage, 1 << 40)  # more than all of them free: every useful layer
    assert everything == [i for i in stage if freed[i] > 0]
