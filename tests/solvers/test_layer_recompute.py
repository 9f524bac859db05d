"""The planner recomputes a few layers instead of whole stages where that is faster and fits."""

from __future__ import annotations

import pytest

import autopipe.solvers.search as search_module
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.solvers.layer_recompute import recompute_layers_where_faster
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import transformer_dag

POOL = [f"gpu:{i}" for i in range(4)]


def _dag() -> Profile:
    prof = transformer_dag(8, hidden_bytes=4 << 20)
    return Profile(prof.df, prof.edges, {**prof.meta, "recompute_ratio": 1.1, "recompute_call_ms": 0.05})


def _fits(plan: Plan) -> bool:
    return all(d.memory is None or plan.device_memory[d.name] <= d.memory for d in plan.devices)


def test_where_memory_binds_a_few_layers_beat_whole_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    prof = _dag()
    free = partition(prof, devices=POOL, chunks=8, recompute="never", method="dp")
    limit = int(max(free.stage_memory) * 0.85)
    kw = dict(devices=POOL, memory_limit=limit, chunks=8, recompute="auto", schedule="gpipe")
    auto = partition(prof, **kw)
    monkeypatch.setattr(search_module, "recompute_layers_where_faster", lambda plan, _: plan)
    stages_only = partition(prof, **kw)
    assert any(m != "never" for m in stages_only.stage_recompute)  # memory binds
    assert auto.recompute_layers and _fits(auto) and _fits(stages_only)
    assert auto.iteration_time < stages_only.iteration_time
    for s, mode in enumerate(auto.stage_recompute):  # only stages that recompute nothing whole
        assert mode == "never" or not set(auto.recompute_layers) & set(auto.stages[s])


def test_without_a_memory_limit_or_recomputation_the_plan_is_kept() -> None:
    prof = _dag()
    never = partition(prof, devices=POOL, chunks=8, recompute="never", method="dp")
    assert recompute_layers_where_faster(never, prof) is never
    forced = partition(prof, devices=POOL, chunks=8, recompute="always", method="dp")  # no limit
    assert recompute_layers_where_faster(forced, prof) is forced


@pytest.mark.parametrize("fraction", [0.45, 0.6, 0.95])
def test_at_any_limit_the_pass_never_makes_a_plan_slower_or_too_big(fraction: float,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prof = _dag()
    free = partition(prof, devices=POOL, chunks=8, recompute="never", method="dp")
    kw = dict(devices=POOL, memory_limit=int(max(free.stage_memory) * fraction), chunks=8,
              recompute="auto", schedule="gpipe")
    auto = partition(prof, **kw)
    monkeypatch.setattr(search_module, "recompute_layers_where_faster", lambda plan, _: plan)
    stages_only = partition(prof, **kw)
    assert _fits(auto) and auto.iteration_time <= stages_only.iteration_time
