"""autopipe/core/plan_checks.py through Plan.from_dict: every malformed field gets its own line."""

from __future__ import annotations

from typing import Any

import pytest

from autopipe.core.plan import Plan
from autopipe.errors import PlanError
from autopipe.solvers.synthetic import chain_profile


def _good() -> dict[str, Any]:
    prof = chain_profile([1.0, 2.0, 3.0])
    return Plan.from_stages(prof, [["l0", "l1"], ["l2"]], chunks=2, recompute="never").to_dict()


def _refused(**edit: Any) -> str:
    with pytest.raises(PlanError) as info:
        Plan.from_dict({**_good(), **edit}, where="p.json")
    text = str(info.value)
    head, tail = "p.json has a malformed field: ", "; re-run `autopipe partition ...`"
    assert text.startswith(head) and text.endswith(tail), text
    return text[len(head):-len(tail)]


def test_a_good_plan_loads() -> None:
    assert Plan.from_dict(_good()).stages == [["l0", "l1"], ["l2"]]
    for edit in ({"batch_size": 8, "micro_batch_size": 4}, {"batch_size": 1, "micro_batch_size": 1},
                 {"batch_size": None}, {"runtime": None},
                 {"runtime": "gpipe"}, {"runtime": "distributed"}, {"recompute": ["never", "always"]},
                 {"data_parallel": 2, "dp_mode": "fsdp"}, {"precision": "bf16"},
                 {"skipped_schedules": {"zbv": "needs 2 stages per rank"}},
                 {"merge_backward": "adjacent"}, {"device_memory": {"a": 1}},
                 {"stage_times": [1, 2.5]}, {"chunks": 1}):
        Plan.from_dict({**_good(), **edit})


@pytest.mark.parametrize("stages", [[["l0", "l1"], []], [["l0", "l1"], "l2"], [["l0", "l1"], [2]],
                                    ("l0", "l1")])
def test_stages(stages: Any) -> None:
    assert _refused(stages=stages) == "'stages' must be a list of non-empty lists of layer names"


@pytest.mark.parametrize("name", ["devices", "stage_times", "stage_memory", "peak_memory", "breakdown"])
def test_one_entry_per_stage(name: str) -> None:
    good = _good()[name]
    assert _refused(**{name: good[:1]}) == f"{name!r} must be a list with one entry per stage (2)"
    if name not in ("devices", "breakdown"):
        assert _refused(**{name: tuple(good)}) == f"{name!r} must be a list with one entry per stage (2)"


@pytest.mark.parametrize("edit", [{"stage_times": [1.0, "2"]}, {"stage_memory": [1, True]},
                                  {"peak_memory": [None, 1]}, {"bottleneck": "1"},
                                  {"iteration_time": None}, {"lower_bound": False},
                                  {"bubble_fraction": "0.5"}])
def test_times_and_memory_are_numbers(edit: dict[str, Any]) -> None:
    assert _refused(**edit) == "times and memory must be numbers"


def test_the_scalar_fields() -> None:
    assert _refused(chunks=0) == "'chunks' must be an integer >= 1, got 0"
    assert _refused(chunks=2.0) == "'chunks' must be an integer >= 1, got 2.0"
    for name in ("batch_size", "micro_batch_size"):
        for bad in (0, True, 2.0, "4"):
            assert _refused(**{name: bad}) == f"{name!r} must be an integer >= 1 or null, got {bad!r}"
    assert _refused(recompute=3) == "'recompute' must be a mode or a list of modes, got 3"
    assert _refused(merge_backward="all") == "'merge_backward' must be one of ['unwaited', 'adjacent'], got 'all'"
    assert _refused(device_memory={"a": 1.5}) == "'device_memory' must map device names to bytes"
    for bad in (0, True, 2.0):
        assert _refused(data_parallel=bad) == f"'data_parallel' must be an integer >= 1, got {bad!r}"
    assert _refused(dp_mode="zero") == "'dp_mode' must be one of ['ddp', 'fsdp'], got 'zero'"
    assert _refused(precision="fp64") == "'precision' must be one of ['fp32', 'bf16', 'fp16'], got 'fp64'"
    assert _refused(runtime="torchrun") == "'runtime' must be one of ['gpipe', 'distributed'] or null, got 'torchrun'"
    for bad in ([], {"zbv": 1}, {2: "x"}):
        assert _refused(skipped_schedules=bad) == "'skipped_schedules' must map schedule names to reasons"


def test_recompute_layers_belong_to_stages_that_do_not_recompute_whole() -> None:
    Plan.from_dict({**_good(), "recompute_layers": ["l0", "l2"]})
    Plan.from_dict({**_good(), "recompute": ["always", "never"], "recompute_layers": ["l2"]})
    message = "'recompute_layers' must list layers of stages whose recompute is 'never'"
    assert _refused(recompute_layers="l0") == message
    assert _refused(recompute_layers=["zz"]) == message  # not a layer of the plan
    assert _refused(recompute_layers=[0]) == message
    assert _refused(recompute=["never", "always"], recompute_layers=["l2"]) == message
    assert _refused(recompute=["always", "never"], recompute_layers=["l0"]) == message
    one = Plan.from_stages(chain_profile([1.0, 2.0]), [["l0", "l1"]], chunks=2, recompute="never").to_dict()
    with pytest.raises(PlanError, match="malformed field: 'recompute_layers' must list"):
        Plan.from_dict({**one, "recompute_layers": ["zz"]})  # one stage: no other to look in
