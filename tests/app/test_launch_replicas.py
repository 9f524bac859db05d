"""`autopipe run --data-parallel D` and examples/train_data_parallel.py: replicas of a pipeline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import autopipe
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.launch import diagnose, run
from autopipe.assemble.setup import microbatch_inputs
from tests import forked
from tests.assemble.test_local import cost_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-stage plan of the mlp at batch 32 in 4 chunks, for one pipeline (data_parallel=1)."""
    ex = autopipe.get_example("mlp", batch_size=32)
    graph = autopipe.trace(ex.model, microbatch_inputs(ex.inputs, 4))
    plan = autopipe.partition(cost_profile(graph), stages=2, method="uniform", chunks=4)
    return plan.save(tmp_path_factory.mktemp("plans") / "mlp2.json")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--nproc", "4", "--data-parallel", "3"],
         "--nproc 4 does not split into --data-parallel 3 replicas; pass --nproc a multiple of 3 "
         "(replicas x stages)"),
        (["--nproc", "4", "--data-parallel", "two"],
         "--data-parallel 'two' is not a number of replicas; pass an integer >= 1 or auto"),
        (["--nproc", "4", "--data-parallel", "2", "--batch-size", "31"],
         "--batch-size 31 does not split into --data-parallel 2 replicas; use a multiple of 2"),
        (["--nproc", "4", "--data-parallel", "2", "--batch-size", "36"],
         "18 rows per replica is not a multiple of --chunks 4: the ranks pass equal micro-batches; "
         "use --batch-size 32 or 40"),
        (["--nproc", "4", "--data-parallel", "2", "--plan", "{plan}"],
         "the plan was made for data_parallel=1 but data_parallel=2 was given; leave it out (the "
         "plan's) or make the plan with `autopipe partition --data-parallel 2`"),
        (["--nproc", "4", "--plan", "{plan}"],
         "the plan has 2 stages but --nproc 4 starts 4 ranks of one stage each; pass --nproc 2, or "
         "re-run `autopipe partition --stages 4` for 4 ranks"),
    ],
)
def test_run_checks_replicas_before_starting_a_rank(
    argv: list[str], line: str, mlp_plan: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    assert main(["run", "mlp", *[a.format(plan=mlp_plan) for a in argv]]) == 2
    assert capsys.readouterr().err == f"autopipe: error: {line}\n"


def test_diagnose_reads_a_replicas_failure(tmp_path: Path) -> None:
    logs = {1: ("PipelineFailure: rank 1/4 (pipeline rank 1/2 of pp group [0, 1], replica 0/2 of dp "
                "group [1, 3]): pipeline step 3 (gpipe, stages [1]) failed: a peer rank died, hung or "
                "failed (Connection closed by peer); see that rank's log\n")}
    line = diagnose(logs, "", 4, tmp_path)
    assert line.startswith("rank 1 stopped at pipeline step 3 (gpipe): a peer rank died or hung "
                           "(Connection closed by peer)"), line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_run_trains_two_replicas(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # 2 replicas of a 1-stage pipeline: rank_main's slicing and the flags, on 2 ranks (the 2 x 2
    # mesh itself is tests/assemble/test_replicas.py's)
    rc = run(RunConfig("mlp", nproc=2, data_parallel="2", dp_mode="fsdp", steps=2, batch_size=16,
                       timeout=30), log_dir=tmp_path)
    out = capfd.readouterr().out
    assert rc == 0, out
    assert out.startswith("mlp on 2 ranks (gpipe, recompute=except_last): batch 16 as 2 replicas "
                          "(fsdp) of 8 rows, in 4 micro-batches of 2 rows; plan "), out
    assert " 0,1      0      15  net.0 .. net.14" in out, out
    assert out.count("loss") == 2 and "mlp: 2 replicas (fsdp) x 1 ranks x 1 stage(s)" in out, out
    assert autopipe.Plan.load(tmp_path / "plan.json").data_parallel == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_data_parallel_script_on_four_ranks_trains_and_merges(tmp_path: Path) -> None:
    """examples/train_data_parallel.py as torchrun starts it, its ranks forked (tests/forked.py)."""
    done = forked.run_script(ROOT / "examples" / "train_data_parallel.py",
                             ["--data-parallel", "2", "--dp-mode", "fsdp", "--steps", "2", "--batch-size", "16",
                              "--chunks", "2", "--out", str(tmp_path)], world=4, timeout=110)
    assert done.exitcodes == [0, 0, 0, 0], done.stderr[-2000:]
    assert done.stdout.count("loss") == 4  # 2 steps x 2 replicas
    assert "(2 replicas x 2 stages, fsdp)" in done.stdout and "merged 2 stage checkpoints" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0.pt", "stage1.pt"]
