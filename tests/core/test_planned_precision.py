"""Planning under a precision: [Note: mixed precision memory], Plan.precision, the mismatch line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.cost import cast_cache_bytes
from autopipe.core.plan import Plan
from autopipe.core.planned_precision import precision_mismatch, precision_of
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError, PlanError, ProfileError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import chain_profile

PARAMS = 1000  # fp32 parameter bytes per layer


def _chain(precision: str | None) -> Profile:
    prof = chain_profile([1.0, 2.0, 3.0, 2.0], param_bytes=PARAMS, output_bytes=10, saved_bytes=50)
    if precision is not None:
        prof.meta["precision"] = precision
    return prof


def test_the_cast_cache_is_the_low_dtype_weights_of_a_stage_that_recomputes() -> None:
    assert cast_cache_bytes(PARAMS, "bf16", 3) == PARAMS / 2
    assert cast_cache_bytes(PARAMS, "fp16", 1) == PARAMS / 2
    assert cast_cache_bytes(PARAMS, "bf16", 0) == 0  # never: the cached copies are the saved ones
    assert cast_cache_bytes(PARAMS, "fp32", 3) == 0


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_plan_of_a_bf16_profile_counts_fp32_state_and_the_cache(mode: str) -> None:
    split = [["l0", "l1"], ["l2", "l3"]]
    fp32 = Plan.from_stages(_chain(None), split, chunks=4, recompute=mode, optimizer="adam")
    bf16 = Plan.from_stages(_chain("bf16"), split, chunks=4, recompute=mode, optimizer="adam")
    assert fp32.precision == "fp32" and bf16.precision == "bf16"
    cache = 2 * PARAMS // 2 if mode == "always" else 0  # two layers' weights in bf16, per stage
    for a, b in zip(fp32.breakdown, bf16.breakdown, strict=True):
        assert b.param_bytes == a.param_bytes + cache  # fp32 weights, grads, Adam's two moments
        assert b.activation_bytes == a.activation_bytes  # measured in the profile's dtype
    assert bf16.peak_memory == [m + cache for m in fp32.peak_memory]  # the simulator agrees


@pytest.mark.parametrize("method", ["exact", "ilp"])
def test_the_solvers_fit_the_cache_into_the_memory_limit(method: str) -> None:
    prof = _chain("bf16")
    # each stage of the even split holds 2 x 4 x PARAMS of Adam state + 50 x 4 saved / 10 x 4 in
    bare = Plan.from_stages(_chain(None), [["l0", "l1"], ["l2", "l3"]], chunks=4, recompute="always")
    limit = max(bare.stage_memory) + PARAMS // 2  # fits fp32's split, not bf16's with its cache
    with pytest.raises(PartitionError, match="memory"):
        partition(prof, devices=["cpu"] * 2, chunks=4, recompute="always", memory_limit=limit,
                  method=method)
    plan = partition(prof, devices=["cpu"] * 2, chunks=4, recompute="always",
                     memory_limit=limit + PARAMS, method=method)
    again = Plan.from_stages(prof, plan.stages, chunks=4, recompute="always")
    assert plan.precision == "bf16" and plan.stage_memory == again.stage_memory
    assert max(plan.stage_memory) <= limit + PARAMS


def test_plan_precision_round_trips_and_an_old_plan_loads_as_fp32(tmp_path: Path) -> None:
    plan = Plan.from_stages(_chain("fp16"), [["l0", "l1"], ["l2", "l3"]], chunks=2)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan and plan.precision == "fp16"
    old = plan.to_dict()
    del old["precision"]
    assert Plan.from_dict(json.loads(json.dumps(old))).precision == "fp32"
    with pytest.raises(PlanError, match="'precision' must be one of"):
        Plan.from_dict({**old, "precision": "int8"})


def test_a_profile_without_precision_is_fp32() -> None:
    assert precision_of({}) == "fp32" and precision_of({"precision": "bf16"}) == "bf16"
    with pytest.raises(ProfileError, match="precision='fp8' is unknown"):
        precision_of({"precision": "fp8"})
    assert Plan.from_stages(_chain(None), [["l0", "l1", "l2", "l3"]], chunks=2).precision == "fp32"


def test_the_mismatch_is_one_line_that_names_both_and_the_fix() -> None:
    assert precision_mismatch("bf16", "bf16") is None
    line = precision_mismatch("fp32", "bf16")
    assert line is not None and "\n" not in line
    assert "'fp32'" in line and "'bf16'" in line and "--precision bf16" in line
    assert "profile was" in (precision_mismatch("bf16", "fp32", what="profile") or "")
