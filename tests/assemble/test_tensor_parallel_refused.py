"""A plan with tensor_parallel > 1 is planned, not run: both entry points refuse it in one line
before tracing, and so does `autopipe run --plan` before torchrun starts a rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopipe.app.cli import main
from autopipe.assemble.local import pipeline
from autopipe.errors import BuildError
from autopipe.solvers.partitioner import partition
from tests.models import Chain
from tests.solvers.test_tensor_parallel_search import _blocks


def test_pipeline_refuses_a_tp_plan_in_one_line() -> None:
    plan = partition(_blocks(), stages=2, devices=4, tensor_parallel=2, chunks=2, progress=False)
    with pytest.raises(BuildError, match="tensor_parallel=2 ranks, which autopipe plans but does not run yet"):
        pipeline(Chain(), torch.randn(4, 8), devices=["cpu", "cpu"], plan=plan)


def test_run_refuses_a_tp_plan_before_any_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = partition(_blocks(), stages=2, devices=4, tensor_parallel=2, chunks=2, progress=False)
    path = plan.save(tmp_path / "tp.json")
    assert main(["run", "mlp", "--plan", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not run yet" in err
