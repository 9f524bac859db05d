"""benchmarks/auto_plan.py runs end to end on tiny profiles (the real numbers: README / report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import auto_plan


@pytest.mark.slow
def test_auto_plan_benchmark_runs_tiny(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["--dag-blocks", "2", "--devices", "3", "--dag-batch", "8", "--dag-chunks", "4",
            "--fractions", "0.8", "--layers", "1", "--hidden", "64", "--intermediate", "128",
            "--heads", "2", "--kv-heads", "1", "--vocab", "100", "--seq", "8", "--batch", "4",
            "--chunks", "2", "--repeats", "1", "--threads", "1",
            "--llama-profile", str(tmp_path / "llama")]
    table = auto_plan.main(argv)
    lines = table.splitlines()
    assert lines[0].startswith("| profile |") and len(lines) >= 4
    assert any(line.startswith("| Llama 1 x 64") for line in lines)
    assert (tmp_path / "llama.csv").exists()  # profiled once, read back the next time
    again = auto_plan.main(argv).splitlines()
    assert [line.split("|")[1:4] for line in again] == [line.split("|")[1:4] for line in lines]



def _check_plans(ap, plans, prof, batch: int) -> None:  # type: ignore[no-untyped-def]
    recipe = plans.recipe
    assert (recipe.num_stages, recipe.chunks, recipe.recompute, recipe.method) == (2, 8, "always", "uniform")
    assert ap._fits(recipe, plans.limit)  # recompute everywhere fits the limit ...
    if plans.binds:  # ... and no split never recomputing at M = 8 does
        with pytest.raises(ap.AutopipeError):
            ap.partition(prof, devices=["cpu:0", "cpu:1"], chunks=8, batch_size=batch, recompute="never",
                         method="dp", memory_limit=plans.limit, progress=False)
    else:  # memory mostly parameters (a tiny batch): then the limit is the recipe's
        assert plans.limit == ap._peak(recipe)
    for auto, single in ((plans.auto, plans.single), (plans.auto_gpipe, plans.single_gpipe)):
        assert ap._fits(auto, plans.limit) and auto.batch_size == batch
        assert single is not None and isinstance(single.recompute, str)
        assert (single.num_stages, single.chunks, single.schedule) == (auto.num_stages, auto.chunks, auto.schedule)
        assert auto.iteration_time <= single.iteration_time * (1 + 1e-9)
    assert plans.auto_gpipe.schedule == "gpipe"


def test_measured_plans_where_memory_binds() -> None:
    """--measured's plan-making on a synthetic DAG whose activations dominate: the limit lies
    between the recipe's peak and the least a never-recompute split at M = 8 needs."""
    ap = auto_plan
    prof = ap.dag_profile(2, 16, 8)
    plans = ap.measured_plans("dag", prof, 0.3)
    assert plans.binds and ap._peak(plans.recipe) < plans.limit
    _check_plans(ap, plans, prof, 16)


def test_measured_one_process_run_tiny() -> None:
    """--measured on a tiny MLP, one process, one step (the 2-rank run spawns processes: left
    to the benchmark itself)."""
    ap = auto_plan
    prof = ap.measured_profile("mlp", 16, repeats=1)
    plans = ap.measured_plans("mlp", prof, 0.3)
    _check_plans(ap, plans, prof, 16)
    rows = ap.measure(plans, steps=1, warmup=0, ranks=False)
    assert [r.name for r in rows] == ["auto", "recipe", "single"]
    assert all(len(r.times) == 1 and r.as_run_ms > 0 for r in rows)
    table = ap.measured_table(rows).splitlines()
    assert len(table) == 5 and table[2].startswith("| mlp, B=16, r=")
