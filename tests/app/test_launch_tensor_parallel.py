"""`autopipe run --plan` of a tensor-parallel plan: which ranks run each stage, and a run under torchrun."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopipe
from autopipe.app.config import RunConfig
from autopipe.app.launch import layout, run
from autopipe.assemble.setup import microbatch_inputs
from tests.assemble.test_local import cost_profile


def _gpt_plan(stages: int, tensor_parallel: int, data_parallel: int = 1, sequence: bool = False) -> autopipe.Plan:
    ex = autopipe.get_example("gpt", batch_size=8)
    graph = autopipe.trace(ex.model, microbatch_inputs(ex.inputs, 2))
    plan = autopipe.partition(cost_profile(graph), stages=stages, method="uniform", chunks=2)  # as the TP test's
    return dataclasses.replace(plan, tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                               sequence_parallel=sequence)


@pytest.mark.parametrize("d, t, schedule, ranks", [
    (1, 2, "gpipe", ["0,1", "2,3"]),
    (2, 2, "gpipe", ["0,1,4,5", "2,3,6,7"]),  # global rank (r x K + s) x t + j
    (1, 1, "gpipe", ["0", "1"]),
])
def test_the_layout_names_each_stages_ranks_as_the_mesh_places_them(d: int, t: int, schedule: str,
                                                                    ranks: list[str]) -> None:
    plan = _gpt_plan(2, t, d)
    config = RunConfig("gpt", nproc=2 * t * d, data_parallel=str(d), batch_size=8, chunks=2, schedule=schedule,
                       recompute="never")
    lines = layout(config, plan, "plan.json").splitlines()
    assert [row.split()[0] for row in lines[2:]] == ranks
    assert (", each stage over TP 2; plan" in lines[0]) == (t == 2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_run_trains_a_tp_plan_under_torchrun(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # TP 2 x PP 2 on 4 ranks, split by tokens too: each TP group's loss said once, the summary names the mesh
    path = _gpt_plan(2, 2, sequence=True).save(tmp_path / "tp.json")
    rc = run(RunConfig("gpt", plan=str(path), nproc=4, steps=2, batch_size=8, timeout=60), log_dir=tmp_path / "logs")
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "each stage over TP 2 split by tokens" in out and " 0,1      0 " in out and " 2,3      1 " in out, out
    assert out.count("loss") == 2 and "gpt: 2 ranks x TP 2 x 1 stage(s)" in out, out
