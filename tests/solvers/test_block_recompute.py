"""[Note: blocks recomputed alone]: where no stage mode fits, every repeated block alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import autopipe
from autopipe.core.cost import LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.devices import DeviceSpec
from autopipe.core.plan import Plan
from autopipe.errors import PartitionError
from autopipe.solvers.block_recompute import fit_blocks, repeated_blocks, with_blocks
from autopipe.solvers.synthetic import random_chain, transformer_dag

MIB = 1 << 20
LIMIT = 880 * MIB  # transformer_dag(8) on 2 stages of 4 micro-batches: no stage mode fits it
ON: dict[str, Any] = {"chunks": 4, "schedule": "1f1b", "bandwidth": None}


def test_the_blocks_are_the_numbered_modules_with_the_functional_layers_inside_them() -> None:
    names = transformer_dag(3).layers
    assert [[names[i] for i in b] for b in repeated_blocks(names)] == [
        [n for n in names if n.startswith(f"h{b}.")] for b in range(3)]
    llama = ["model.embed_tokens", "model.rotary_emb"]
    for b in range(3):
        llama += [f"model.layers.{b}.input_layernorm", f"model.layers.{b}.self_attn.q_proj", f"mul_{b}",
                  f"model.layers.{b}.mlp.down_proj", f"add_{b}"]
    llama += ["model.norm", "lm_head"]
    blocks = repeated_blocks(llama)
    assert [[llama[i] for i in b] for b in blocks][2] == ["model.layers.2.input_layernorm",
                                                          "model.layers.2.self_attn.q_proj", "mul_2",
                                                          "model.layers.2.mlp.down_proj", "add_2"]
    assert [len(b) for b in blocks] == [5, 5, 5]
    # the last block ends at the first layer of another module path, even a shorter one
    assert [llama[i] for i in repeated_blocks([*llama[:-2], "model.norm", "x"])[-1]][-1] == "add_2"
    assert repeated_blocks(["embed", "fc", "head"]) == [] == repeated_blocks(["a.b0.c", "d"])


def _whole_stage_fits(prof: autopipe.Profile, limit: int) -> bool:
    """Brute force: some split of two stages, each in some stage mode, fits ``limit``."""
    costs = LayerCosts.from_profile(prof)
    n, devices = len(costs), [DeviceSpec("d0"), DeviceSpec("d1")]
    for cut in range(1, n):
        split = [0] * cut + [1] * (n - cut)
        per_mode = [stage_costs(costs, split, devices, CostOptions(recompute=mode, **ON))
                    for mode in ("never", "except_last", "always")]
        if all(min(st[s].memory_bytes for st in per_mode) <= limit for s in range(2)):
            return True
    return False


def _equal_blocks_alone(prof: autopipe.Profile) -> Plan:
    """By hand: four blocks a stage, each recomputed alone."""
    names = prof.layers
    cut = names.index("h4.ln1")
    blocks = [f"h{b}." for b in range(8)]
    layers = [n for n in names if n.startswith(tuple(blocks))]
    return Plan.from_stages(prof, [names[:cut], names[cut:]], devices=["d0", "d1"], recompute="never",
                            recompute_layers=layers, segment_starts=[f"{b}ln1" for b in blocks], **ON)


def test_where_no_stage_mode_fits_the_search_recomputes_blocks_alone_and_fits() -> None:
    prof = transformer_dag(8)
    assert not _whole_stage_fits(prof, LIMIT)  # the truth: no stage mode of any split fits
    by_hand = _equal_blocks_alone(prof)
    assert by_hand.highest_memory <= LIMIT  # but blocks recomputed alone do
    merged = Plan.from_stages(prof, by_hand.stages, devices=["d0", "d1"], recompute="never",
                              recompute_layers=by_hand.recompute_layers, **ON)
    assert merged.highest_memory > LIMIT  # and merged into one segment a stage they do not
    plan = autopipe.partition(prof, stages=2, devices=2, recompute="auto", memory_limit=LIMIT, progress=False,
                              **ON)
    assert all(m <= LIMIT for m in plan.device_memory.values())
    assert all(m <= LIMIT for m in plan.stage_memory)
    assert plan.stage_recompute == ["never", "never"] and len(plan.segment_starts) > 2
    assert plan.iteration_time <= by_hand.iteration_time
    again = Plan.from_stages(prof, plan.stages, devices=plan.devices, recompute="never",
                             recompute_layers=plan.recompute_layers, segment_starts=plan.segment_starts, **ON)
    assert again.device_memory == plan.device_memory and again.iteration_time == pytest.approx(plan.iteration_time)
    assert plan.method == "heuristic" and plan.solver.status.startswith("heuristic: no stage mode fits")
    assert plan.solver.gap is not None and plan.solver.gap > 0
    assert "segments recomputed alone" in plan.explain()


def test_a_stage_keeps_its_last_blocks_where_they_fit() -> None:
    prof = transformer_dag(8)
    costs = LayerCosts.from_profile(prof)
    blocks = repeated_blocks(costs.names)
    devices = [DeviceSpec("d0"), DeviceSpec("d1")]
    options = CostOptions(recompute="never", **ON)
    split = [0] * costs.names.index("h4.ln1") + [1] * (len(costs) - costs.names.index("h4.ln1"))

    def memory(kept: list[int]) -> list[int]:
        layers, starts = with_blocks(costs, split, blocks, kept)
        return [st.memory_bytes for st in stage_costs(costs, split, devices, replace(
            options, recompute_layers=layers, segment_starts=starts))]

    limit = memory([2, 2])[0] + MIB // 4  # room for two kept blocks on stage 0, not three
    assert memory([3, 3])[0] > limit
    # the truth: each stage keeps the most last blocks that fit (its memory is its own)
    most = [max(j for j in range(5) if memory([j, j])[s] <= limit) for s in range(2)]
    assert most[0] == 2 and 0 < most[1] < 4
    budgets = [DeviceSpec("d0", limit), DeviceSpec("d1", limit)]
    found = fit_blocks(costs, devices, budgets, options, split, blocks)
    assert found is not None
    assert found.layers == with_blocks(costs, split, blocks, most)[0]
    assert found.starts[:2] == ("h0.ln1", "h1.ln1") and len(found.starts) == 8 - sum(most)
    assert [st.memory_bytes for st in found.stages] == memory(most)
    small = [DeviceSpec("d0", memory([0, 0])[0] - 1), DeviceSpec("d1", limit)]
    assert fit_blocks(costs, devices, small, options, split, blocks) is None  # not even all of them


def test_where_nothing_fits_the_error_says_what_blocks_alone_need() -> None:
    prof = random_chain(12, 0)
    with pytest.raises(PartitionError, match=r"^no searched configuration fits the memory") as plain:
        autopipe.partition(prof, stages=2, devices=2, recompute="auto", memory_limit=1, progress=False, **ON)
    assert "block" not in str(plain.value) and "\n" not in str(plain.value)  # no stack of blocks to name
    dag = transformer_dag(8)
    with pytest.raises(PartitionError, match=r"; with every repeated block recomputed alone, ([\d.]+) MiB "
                                             r"on the splits tried$") as blocks:
        autopipe.partition(dag, stages=2, devices=2, recompute="auto", memory_limit=800 * MIB, progress=False,
                           **ON)
    said = float(str(blocks.value).rsplit(", ", 1)[1].split(" MiB")[0])
    assert 800 < said <= _equal_blocks_alone(dag).highest_memory / MIB + 0.1  # the by-hand split is one tried
