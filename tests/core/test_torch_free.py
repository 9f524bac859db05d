"""The planner (Profile -> partition -> simulate -> Plan JSON) runs on a machine without torch,
the automatic search (stages, chunks, recomputation per stage, schedule) included."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# Importing a module whose sys.modules entry is None raises ImportError, as on a machine where
# torch is not installed; anything that imports torch (even lazily, in a function) fails.
_PLAN_WITHOUT_TORCH = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None
    import autopipe
    from autopipe.core.profile_table import Profile
    from autopipe.solvers.synthetic import random_chain, transformer_dag

    random_chain(12).save(sys.argv[1] + "/chain.csv")
    prof = Profile.load(sys.argv[1] + "/chain.csv")
    for profile, method in ((prof, "auto"), (transformer_dag(2), "ilp"), (prof, "uniform")):
        plan = autopipe.partition(profile, stages=3, chunks=4, memory_limit="1TiB", method=method)
        sim = autopipe.simulate(plan, profile, schedule="1f1b")
        assert sim.iteration_time > 0 and len(sim.peak_memory) == 3
    prof.meta.update(micro_batch_size=4, batch_size=16, chunks=4)
    auto = autopipe.partition(prof, stages="auto", devices=["a", "b", "c"], chunks="auto",
                              recompute="auto", schedule="auto", memory_limit="64MiB")
    assert auto.alternatives and "Next best" in auto.explain()
    for schedule in ("gpipe", "1f1b", "interleaved1f1b"):
        sim = autopipe.simulate(auto, prof, schedule=schedule) if schedule == auto.schedule else None
        assert sim is None or sim.iteration_time > 0
    mixed = autopipe.partition(prof, stages=2, chunks=4, recompute=["always", "never"],
                               schedule="1f1b")
    replicas = autopipe.partition(prof, devices=4, data_parallel="auto", dp_mode="fsdp", chunks=2)
    assert any(a.data_parallel != replicas.data_parallel for a in replicas.alternatives)
    for plan in (auto, mixed, replicas):
        plan.save(sys.argv[1] + "/plan.json", overwrite=True)
        again = autopipe.Plan.load(sys.argv[1] + "/plan.json")
        assert again == plan, "a plan survives JSON unchanged"
        json.dumps(again.to_dict())
    print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
""")


def test_planning_runs_with_torch_blocked(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _PLAN_WITHOUT_TORCH, str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['torch']", out.stdout  # only the blocking None entry


def test_executor_spec_imports_no_torch() -> None:
    code = "import sys; import executor.spec, executor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
