from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autopipe.core.plan import Alternative, Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PlanError, ProfileError
from autopipe.solvers.synthetic import chain_profile, random_chain


def _plan() -> Plan:
    prof = random_chain(6, 2)
    prof.meta["fingerprint"] = "fp1"
    return Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=4)


def test_from_stages_numbers() -> None:
    prof = chain_profile([1.0, 2.0, 3.0, 6.0], output_bytes=0, saved_bytes=0)
    plan = Plan.from_stages(prof, [["l0", "l1", "l2"], ["l3"]], chunks=2, recompute="never")
    assert plan.stage_times == [18.0, 18.0]  # fwd + 2 x fwd backward
    assert plan.bottleneck == 18.0 and plan.lower_bound == 18.0
    assert plan.iteration_time == 3 * 18.0  # (M + K - 1) x bottleneck
    assert [b.fwd_ms for b in plan.breakdown] == [6.0, 6.0]
    assert plan.method == "manual" and plan.num_stages == 2


def test_from_stages_rejects_bad_splits() -> None:
    prof = chain_profile([1.0] * 3)
    with pytest.raises(PlanError, match="'l1' is in stage 0 and stage 1"):
        Plan.from_stages(prof, [["l0", "l1"], ["l1", "l2"]])
    with pytest.raises(PlanError, match="stage 1 of 2 is empty"):
        Plan.from_stages(prof, [["l0", "l1", "l2"], []])
    with pytest.raises(PlanError, match="runs backwards"):
        Plan.from_stages(prof, [["l0", "l2"], ["l1"]])
    with pytest.raises(PlanError, match="unassigned.*'l2'"):
        Plan.from_stages(prof, [["l0"], ["l1"]])
    with pytest.raises(PlanError, match="not in the profile.*'zz'"):
        Plan.from_stages(prof, [["l0", "l1"], ["l2", "zz"]])


def test_save_load_roundtrip(tmp_path: Path) -> None:
    plan = _plan()
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == plan


def test_save_refuses_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "p.json"
    target.write_text("keep me")
    with pytest.raises(PlanError, match="already exists.*overwrite=True"):
        _plan().save(target)
    assert target.read_text() == "keep me"
    _plan().save(target, overwrite=True)
    assert Plan.load(target).fingerprint == "fp1"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: "{\n  oops", r"not valid JSON \(line 2\)"),
        (lambda d: json.dumps([1, 2]), "not an autopipe plan"),
        (lambda d: json.dumps({k: v for k, v in d.items() if k != "stages"}), r"lacks key\(s\) \['stages'\]"),
        (lambda d: json.dumps({**d, "stage_times": [1.0]}), "'stage_times' must be a list with one entry per stage"),
        (lambda d: json.dumps({**d, "chunks": "four"}), "malformed field"),
        (lambda d: json.dumps({**d, "stages": [["a"], "b"]}), "'stages' must be a list"),
        (lambda d: json.dumps({**d, "recompute": "sometimes"}), "malformed field.*recompute"),
    ],
)
def test_load_rejects_bad_files(tmp_path: Path, edit, match) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.json"
    path.write_text(edit(_plan().to_dict()))
    with pytest.raises(PlanError, match=match):
        Plan.load(path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "none.json")


def test_check_against_graph() -> None:
    plan = _plan()
    layers = [n for s in plan.stages for n in s]
    plan.check(layers, "fp1")
    plan.check(layers, None)
    with pytest.raises(PlanError, match="fingerprint fp1 but this graph has fp2 .another model or micro-batch shape"):
        plan.check(layers, "fp2")
    with pytest.raises(PlanError, match="unassigned.*'extra'"):
        plan.check([*layers, "extra"], "fp1")
    with pytest.raises(PlanError, match="not in the graph"):
        plan.check(layers[:-1], "fp1")


def _two_part_plan() -> Plan:
    prof = random_chain(6, 2)
    prof.meta.update(fingerprint="aaaa.s1", batch_size=32, chunks=4, micro_batch_size=8)
    return Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=4)


def test_a_plan_of_other_chunks_records_the_batch_of_its_profiles_micro_batch() -> None:
    # the profile measured 8-row micro-batches (batch 32 in 4); planned for 8 or 2 of them
    # without a batch size, the plan keeps that micro-batch, so its batch is 64 or 16 rows: what
    # `autopipe run --plan` and `train --plan` then default to ([Note: one chunks rule])
    prof = random_chain(6, 2)
    prof.meta.update(fingerprint="aaaa.s1", batch_size=32, chunks=4, micro_batch_size=8)
    for chunks, batch in ((4, 32), (8, 64), (2, 16)):
        plan = Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=chunks)
        assert (plan.batch_size, plan.micro_batch_size, plan.chunks) == (batch, 8, chunks)
        replicas = Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=chunks, data_parallel=2)
        assert replicas.batch_size == 2 * batch
    prof.meta.update(batch_size=30)  # 30 rows in 4: the first 8 make the micro-batch
    assert Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=4).batch_size == 30


def test_check_says_whether_the_model_or_the_micro_batch_differs() -> None:
    plan = _two_part_plan()
    assert (plan.batch_size, plan.micro_batch_size) == (32, 8)
    layers = [n for s in plan.stages for n in s]
    plan.check(layers, "aaaa.s1")
    plan.check(layers, "aaaa")  # a graph fingerprinted before the structure part: same FULL
    with pytest.raises(PlanError, match=r"^plan was made for graph fingerprint aaaa.s1 but this graph "
                       r"has bbbb.s2: the plan is for another model \(its layers or parameter shapes "
                       r"differ\); re-run autopipe profile and autopipe partition for this model$"):
        plan.check(layers, "bbbb.s2")
    with pytest.raises(PlanError, match=r": same model, another micro-batch shape \(the plan's micro-batch "
                       r"is 8 rows \(batch 32 in 4 chunks\), this one's 16 rows; .*\); use the plan's "
                       r"batch size and chunks, or re-run autopipe profile and autopipe partition"):
        plan.check(layers, "bbbb.s1", micro_batch_size=16)


def test_plans_saved_before_the_batch_fields_still_load(tmp_path: Path) -> None:
    data = _two_part_plan().to_dict()
    del data["batch_size"], data["micro_batch_size"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.micro_batch_size is None and old.stages == _two_part_plan().stages
    with pytest.raises(PlanError, match=r"the plan's micro-batch is unrecorded; "):
        old.check([n for s in old.stages for n in s], "bbbb.s1")
    (tmp_path / "bad.json").write_text(json.dumps({**data, "micro_batch_size": "eight"}))
    with pytest.raises(PlanError, match="'micro_batch_size' must be an integer >= 1 or null"):
        Plan.load(tmp_path / "bad.json")


def test_table_keeps_whole_layer_names() -> None:
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    prof = Profile.from_frame(chain_profile([1.0] * 4).df.assign(layer=names))
    table = Plan.from_stages(prof, [names[:2], names[2:]]).table()
    assert "model.layers.0.self_attn.q_proj .. model.layers.1.self_attn.q_proj" in table
    assert "model.layers.2.self_attn.q_proj .. model.layers.3.self_attn.q_proj" in table
    assert len({len(line) for line in table.splitlines()}) == 1  # columns stay aligned


def test_explain_names_the_limit() -> None:
    big = chain_profile([1.0, 1.0, 20.0, 1.0])
    text = Plan.from_stages(big, [["l0", "l1"], ["l2", "l3"]], chunks=2).explain()
    assert "stage 1" in text and "bottleneck" in text and "lower bound" in text
    assert "big layer 'l2'" in text
    wide = chain_profile([1.0] * 4, output_bytes=10**9)
    text = Plan.from_stages(wide, [["l0", "l1"], ["l2", "l3"]], bandwidth=1e9).explain()
    assert "transfers" in text
    tight = Plan.from_stages(chain_profile([1.0] * 4, param_bytes=[10**6] * 4), [["l0"], ["l1", "l2", "l3"]],
                             memory_limit=10**6)
    assert "memory: stage 0 needs" in tight.explain()
    assert "stage" in tight.table() and "share" in tight.table()


def test_profile_check_says_whether_the_model_or_the_micro_batch_differs() -> None:
    prof = random_chain(3, 1)
    prof.meta.update(fingerprint="aaaa.s1", batch_size=256, chunks=4, micro_batch_size=64)
    prof.check_fingerprint("aaaa.s1")
    prof.check_fingerprint("aaaa")
    with pytest.raises(ProfileError, match=r"^profile fingerprint aaaa.s1 does not match the model's "
                       r"fingerprint bbbb.s2: the profile was measured on another model"):
        prof.check_fingerprint("bbbb.s2")
    with pytest.raises(ProfileError, match=r"same model, another micro-batch shape \(the profile's "
                       r"micro-batch is 64 rows \(batch 256 in 4 chunks\)\); use that batch size"):
        prof.check_fingerprint("bbbb.s1")


def test_a_one_part_fingerprint_still_names_the_micro_batches() -> None:
    prof = random_chain(4, 0)  # like the committed profiles: fingerprinted before the STRUCTURE part
    prof.meta.update(fingerprint="aaaa", batch_size=256, chunks=4, micro_batch_size=64)
    plan = Plan.from_stages(prof, [prof.layers[:2], prof.layers[2:]], chunks=4)
    with pytest.raises(PlanError, match=r"^plan was made for graph fingerprint aaaa but this graph has bbbb.s1 "
                       r"\(another model or micro-batch shape; the plan's micro-batch is 64 rows \(batch 256 "
                       r"in 4 chunks\), this one's 8 rows\); use the plan's batch size and chunks, or re-run "
                       r"autopipe profile and autopipe partition for this model/batch$"):
        plan.check(prof.layers, "bbbb.s1", micro_batch_size=8)


def test_per_stage_checkpoint_roundtrips_and_one_mode_stays_a_string(tmp_path: Path) -> None:
    prof = random_chain(6, 2)
    mixed = Plan.from_stages(prof, [prof.layers[:2], prof.layers[2:4], prof.layers[4:]],
                             recompute=["always", "never", "never"], chunks=4, schedule="1f1b")
    assert mixed.recompute == ["always", "never", "never"] and mixed.schedule == "1f1b"
    assert [b.recompute_ms > 0 for b in mixed.breakdown] == [True, False, False]
    mixed.save(tmp_path / "mixed.json")
    assert Plan.load(tmp_path / "mixed.json") == mixed
    same = Plan.from_stages(prof, mixed.stages, recompute=["never"] * 3, chunks=4)
    assert same.recompute == "never" and same.stage_recompute == ["never"] * 3
    assert "never" in same.table().splitlines()[1]
    data = mixed.to_dict()
    (tmp_path / "bad.json").write_text(json.dumps({**data, "recompute": ["always", "never"]}))
    with pytest.raises(PlanError, match=r"malformed field: recompute lists 2 mode\(s\) for 3 stage\(s\)"):
        Plan.load(tmp_path / "bad.json")


def test_plans_saved_when_recompute_was_called_checkpoint_still_load(tmp_path: Path) -> None:
    """[Note: plan fields over time]: the plan's and each alternative's ``checkpoint``."""
    prof = random_chain(6, 2)
    plan = Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], recompute=["always", "never"],
                            chunks=4)
    plan = dataclasses.replace(plan, alternatives=[Alternative(2, 8, "gpipe", "never", 1.0, 2.0, 3)])
    data = plan.to_dict()
    data["checkpoint"] = data.pop("recompute")
    data["alternatives"] = [{("checkpoint" if k == "recompute" else k): v
                             for k, v in a.items()} for a in data["alternatives"]]
    assert "recompute" not in json.dumps(data).replace("recompute_", "")
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json") == plan
    with pytest.warns(DeprecationWarning, match=r"^plan.checkpoint is now plan.recompute"):
        assert plan.checkpoint == ["always", "never"]


def test_plans_saved_before_schedules_still_load(tmp_path: Path) -> None:
    data = _plan().to_dict()
    for key in ("schedule", "alternatives", "device_memory"):
        del data[key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json")
    assert old.schedule == "gpipe" and old.alternatives == [] and old.device_memory == {}
    assert "Next best" not in old.explain() and old.stages == _plan().stages


def test_a_plan_for_another_micro_batch_checks_structure_and_rows() -> None:
    prof = random_chain(6, 2)
    prof.meta.update(fingerprint="aaaa.s1", micro_batch_size=8, batch_size=32, chunks=4)
    from autopipe.core.scaling import profile_at

    plan = Plan.from_stages(profile_at(prof, 4, batch_size=32, chunks=8),
                            [prof.layers[:3], prof.layers[3:]], chunks=8)
    assert plan.fingerprint == "*.s1" and (plan.micro_batch_size, plan.batch_size) == (4, 32)
    layers = prof.layers
    plan.check(layers, "cccc.s1", micro_batch_size=4)  # the graph traced at 4 rows
    plan.check(layers, "cccc.s1")
    with pytest.raises(PlanError, match="the plan is for another model"):
        plan.check(layers, "cccc.s2")
    with pytest.raises(PlanError, match=r"same model, another micro-batch shape \(the plan's micro-batch is "
                       r"4 rows \(batch 32 in 8 chunks\), this one's 8 rows"):
        plan.check(layers, "aaaa.s1", micro_batch_size=8)


def test_explain_says_memory_binds_and_where() -> None:
    prof = chain_profile([1.0] * 4, param_bytes=[0] * 4, output_bytes=1, saved_bytes=1 << 20)
    # stage 0 keeps 4 micro-batches x 3 MiB without recomputation; stage 1 fits them (4 x 1 MiB)
    plan = Plan.from_stages(prof, [["l0", "l1", "l2"], ["l3"]], chunks=4, recompute=["always", "never"],
                            memory_limit=6 << 20, optimizer="none")
    text = plan.explain()
    assert "recomputation always, never" in text
    assert ("Limited by memory: stage 0 recomputes (always) because without it it needs 12.0 MiB "
            "and stage0 has 6.0 MiB; stages that fit run without recomputation.") in text


def _mixed_plan() -> Plan:
    prof = random_chain(6, 2)
    return Plan.from_stages(prof, [prof.layers[:2], prof.layers[2:]], chunks=4,
                            recompute=["always", "never"])


def test_a_plans_decision_is_what_it_says_to_run(tmp_path: Path) -> None:
    plan = _mixed_plan()
    d = plan.decision
    assert d.stages == tuple(tuple(s) for s in plan.stages) and d.chunks == 4
    assert d.recompute == ("always", "never") and d.devices == tuple(x.name for x in plan.devices)
    assert (d.schedule, d.merge_backward, d.data_parallel, d.dp_mode, d.precision) == (
        plan.schedule, plan.merge_backward, plan.data_parallel, plan.dp_mode, plan.precision)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").decision == d  # a saved plan decides the same
