"""autopipe.app.launch (`autopipe run`), autopipe.app.rank_main and the torchrun user script."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import autopipe
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.launch import diagnose, torchrun_command
from autopipe.app.rank_main import main as rank_main
from autopipe.assemble.setup import microbatch_inputs
from autopipe.errors import BuildError
from executor.ranks.distributed import DistributedPipeline
from tests import forked

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_command_names_every_setting(tmp_path: Path) -> None:
    cmd = torchrun_command(RunConfig("mlp", nproc=3, plan="plans/mlp.json", steps=2, chunks=4), tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=3" in cmd and cmd[cmd.index("-m", 3) + 1] == "autopipe.app.rank_main"
    assert cmd[cmd.index("--log-dir") + 1] == str(tmp_path) and cmd[cmd.index("--redirects") + 1] == "2"
    sent = RunConfig.from_json(cmd[cmd.index("--config") + 1])  # what every rank reads
    assert sent == RunConfig("mlp", nproc=3, plan="plans/mlp.json", steps=2, chunks=4)
    assert sent.recompute is None  # left to the plan


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"model": "resnet"}, r"unknown example 'resnet'; `autopipe run` trains one of \['cnn', 'gpt', "
                              r"'mlp', 'unet'\] or a 'package.module:factory'$"),
        ({"model": "mlp", "nproc": 0}, "--nproc 0 < 1"),
        ({"model": "mlp", "steps": 0}, "--steps 0 < 1"),
        ({"model": "mlp", "chunks": 0}, r"^--chunks 0 < 1: pass --chunks 1 or more$"),
        ({"model": "mlp", "threads": 0}, r"^--threads 0 < 1: pass --threads 1 or more$"),
        ({"model": "mlp", "schedule": "zb"}, "--schedule 'zb' is unknown"),
        ({"model": "mlp", "clip_grad": 0.0}, r"^--clip-grad 0.0 must be > 0 .*, e.g. --clip-grad 1.0$"),
        ({"model": "mlp", "precision": "fp8"},
         r"^--precision 'fp8' is unknown; use one of \['fp32', 'bf16', 'fp16'\]$"),
    ],
)
def test_bad_run_configs(flags: dict[str, Any], match: str) -> None:
    with pytest.raises(BuildError, match=match):  # refused when made ([Note: flags checked when made])
        RunConfig(**flags)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2- and 3-stage mlp plans made at batch 16 in 4 chunks, and a cnn plan."""
    out = tmp_path_factory.mktemp("plans")
    made = {}
    for name, stages in (("mlp", 2), ("mlp", 3), ("cnn", 2)):
        ex = autopipe.get_example(name, batch_size=16)
        prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=1, warmup=0)
        made[f"{name}{stages}"] = autopipe.partition(prof, stages=stages).save(out / f"{name}{stages}.json")
    return made


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--plan", "{mlp2}", "--nproc", "3"],
         "the plan has 2 stages but --nproc 3 starts 3 ranks of one stage each; pass --nproc 2, or re-run "
         "`autopipe partition --stages 3` for 3 ranks"),
        (["--plan", "{mlp3}", "--nproc", "2", "--schedule", "interleaved1f1b"],
         "the plan has 3 stages, which 2 ranks cannot share equally (--schedule interleaved1f1b gives each "
         "rank the same number); pass --nproc a divisor of 3, or re-run `autopipe partition --stages 4`"),
        (["--plan", "{mlp2}", "--batch-size", "30"],
         "--batch-size 30 is not a multiple of --chunks 4: the ranks pass equal micro-batches; use "
         "--batch-size 28 or 32"),
        (["--nproc", "20"],
         "--nproc 20 needs 20 stages of at least one layer each, but mlp traces to 15 layers; use --nproc "
         "15 or fewer"),
        (["--plan", "{mlp2}", "--batch-size", "32"],
         "plan was made for graph fingerprint {fp} but this graph has {other}: same model, another "
         "micro-batch shape (the plan's micro-batch is 4 rows (batch 16 in 4 chunks), this one's 8 rows; "
         "a micro-batch is the first ceil(batch / chunks) rows); use the plan's batch size and chunks, or "
         "re-run autopipe profile and autopipe partition for this batch and chunks"),
        (["--plan", "{cnn2}"], "plan was made for graph fingerprint {cnnfp} but this graph has {fp}: the plan "
                               "is for another model (its layers or parameter shapes differ); re-run autopipe "
                               "profile and autopipe partition for this model"),
    ],
)
def test_run_checks_plan_ranks_and_batch_before_starting_a_rank(
    argv: list[str], line: str, plans: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    mlp, cnn = autopipe.Plan.load(plans["mlp2"]), autopipe.Plan.load(plans["cnn2"])
    ex = autopipe.get_example("mlp", batch_size=32)
    other = autopipe.trace(ex.model, microbatch_inputs(ex.inputs, 4)).fingerprint
    fields = {"mlp2": plans["mlp2"], "mlp3": plans["mlp3"], "cnn2": plans["cnn2"], "fp": mlp.fingerprint,
              "cnnfp": cnn.fingerprint, "other": other}
    assert main(["run", "mlp", *[a.format(**fields) for a in argv]]) == 2
    assert capsys.readouterr().err == f"autopipe: error: {line.format(**fields)}\n"


def test_cli_run_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "mlp", "--nproc", "0"]) == 2
    assert capsys.readouterr().err == "autopipe: error: --nproc 0 < 1: a pipeline needs at least one process\n"


_TORCHRUN_ROOT = """E1130 03:10:20 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 14114)
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 14113)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_03:10:20
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 14114)
============================================================
"""
_FAILURE = ("PipelineFailure: rank {r}/2: pipeline step 3 (gpipe, stages [{r}]) failed: a peer rank died, "
            "hung or failed ({cause}); see that rank's log\n")


def test_diagnose_names_rank_peer_and_step(tmp_path: Path) -> None:
    # the last rank was killed (OOM killer, SIGKILL) while rank 0 waited on it
    logs = {0: "noise\n" + _FAILURE.format(r=0, cause="Connection reset by peer"), 1: ""}
    assert diagnose(logs, _TORCHRUN_ROOT.format(rank=1, code=-9), 2, tmp_path) == (
        f"rank 0 stopped at pipeline step 3 (gpipe): its peer rank 1 was killed by SIGKILL; the ranks' "
        f"logs are in {tmp_path}")
    # both ranks' watchdogs fired: the peer is the other rank of two, and it died or hung
    logs = {r: _FAILURE.format(r=r, cause="no progress for 9s") for r in (0, 1)}
    assert diagnose(logs, _TORCHRUN_ROOT.format(rank=1, code=3), 2, tmp_path) == (
        f"rank 0 stopped at pipeline step 3 (gpipe): its peer rank 1 died or hung; the ranks' logs are in "
        f"{tmp_path}")
    # of more ranks, an unknown peer: the cause is quoted instead
    assert diagnose({2: _FAILURE.format(r=2, cause="timeout").replace("/2", "/4")},
                    _TORCHRUN_ROOT.format(rank=2, code=3), 4, tmp_path).startswith(
        "rank 2 stopped at pipeline step 3 (gpipe): a peer rank died or hung (timeout)")


def test_diagnose_prefers_a_ranks_own_error_and_falls_back_to_its_traceback(tmp_path: Path) -> None:
    own = {0: "", 1: "autopipe run: error on rank 1 at step 2: target batch size 6 is not a multiple of chunks=4\n"}
    assert diagnose(own, _TORCHRUN_ROOT.format(rank=1, code=2), 2, tmp_path) == (
        f"rank 1 at step 2: target batch size 6 is not a multiple of chunks=4; the ranks' logs are in {tmp_path}")
    building = {0: "autopipe run: error on rank 0: layer 'x' is not the model's own\n"}
    assert diagnose(building, "", 2, tmp_path).startswith("rank 0 while building its stage: layer 'x'")
    crash = {0: 'Traceback (most recent call last):\n  File "m.py", line 3\nRuntimeError: mat1 and mat2 '
                'shapes cannot be multiplied (8x3 and 8x16)\n'}
    assert diagnose(crash, _TORCHRUN_ROOT.format(rank=0, code=1), 2, tmp_path) == (
        "rank 0 exited with status 1: RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x3 and 8x16); "
        f"its log is {tmp_path / 'rank0.log'}")


def test_rank_main_refuses_to_run_outside_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert rank_main(["--config", RunConfig("mlp").to_json()]) == 2
    assert "start me with torchrun" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_run_trains_a_bundled_example_with_a_saved_plan(plans: dict[str, Path], tmp_path: Path,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    from autopipe.app.launch import run

    # more threads than the cores each rank is pinned to ([Note: ranks pinned to cores]): said once
    per_rank = len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity") else 0
    threads = max(per_rank, 1) + 1
    rc = run(RunConfig("mlp", plan=str(plans["mlp2"]), nproc=2, steps=3, timeout=30, threads=threads,
                       clip_grad=1.0), log_dir=tmp_path)
    out, err = capfd.readouterr()
    assert rc == 0, out
    if per_rank >= 1:
        assert err.count(f"autopipe run: warning: --threads {threads} on {per_rank} core(s) per rank; pass "
                         f"--threads {per_rank}, or --no-pin-cores to share all cores") == 1, err
    plan = autopipe.Plan.load(plans["mlp2"])
    (first, last), layers = plan.spans(), [len(s) for s in plan.stages]
    assert out.startswith(f"mlp on 2 ranks (gpipe, recompute=except_last): batch 16 in 4 micro-batches "
                          f"of 4 rows; plan {plans['mlp2']}\n")  # batch and chunks from the plan
    assert f"   0      0  {layers[0]:>6}  {first}" in out and f"   1      1  {layers[1]:>6}  {last}" in out
    assert out.count("loss") == 3 and "samples/s" in out and "2 ranks" in out
    norms = [float(v) for v in re.findall(r"loss \S+  grad norm (\S+)$", out, flags=re.M)]
    assert len(norms) == 3 and all(math.isfinite(v) and v > 0 for v in norms)  # --clip-grad reached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.log", "rank1.log", "torchrun", "torchrun.log"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_rank_killed_mid_run_ends_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "dies_at_step3.py").write_text(
        "import os, signal\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n"
        "def make(batch_size):\n"
        "    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
        "    calls = [0]\n"
        "    def loss_fn(out, y):\n"
        "        calls[0] += 1\n"
        "        # the first micro-batch of step 3 on the last rank (the launcher times the loss too)\n"
        "        if 'RANK' in os.environ and calls[0] == 9:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return F.cross_entropy(out, y)\n"
        "    return model, torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,)), loss_fn\n"
    )
    monkeypatch.chdir(tmp_path)  # the factory's module is found in the current directory
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["run", "dies_at_step3:make", "--nproc", "2", "--steps", "5", "--batch-size", "16",
                 "--timeout", "20"]) == 2
    out, err = capfd.readouterr()
    assert "step    2/5" in out and "step    3/5" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autopipe: error: rank 0 stopped at pipeline step 3 (gpipe): its peer rank 1 "
                               "was killed by SIGKILL; the ranks' logs are in ")
    logs = Path(lines[0].rsplit(" ", 1)[1])
    assert "PipelineFailure: rank 0/2: pipeline step 3" in (logs / "rank0.log").read_text()
    assert (logs / "plan.json").exists()  # made before the ranks started


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_user_script_on_two_ranks_trains_and_merges(tmp_path: Path) -> None:
    """examples/train_distributed.py as torchrun starts it, its ranks forked (tests/forked.py)."""
    done = forked.run_script(ROOT / "examples" / "train_distributed.py",
                             ["--steps", "2", "--batch-size", "16", "--chunks", "4", "--out", str(tmp_path)],
                             world=2, timeout=80)
    assert done.exitcodes == [0, 0], done.stderr[-2000:]
    assert done.stdout.count("loss") == 2 and "merged 2 stage checkpoints" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]


def test_run_takes_the_plans_schedule_unless_told(plans: dict[str, Path], tmp_path: Path) -> None:
    from autopipe.app.launch import prepare
    from autopipe.core.plan import Plan

    one_f = Plan.load(plans["mlp2"])
    path = dataclasses.replace(one_f, schedule="1f1b").save(tmp_path / "mlp2_1f1b.json")
    resolved, _, _ = prepare(RunConfig("mlp", plan=str(path), nproc=2), tmp_path)
    assert resolved.schedule == "1f1b"
    resolved, _, _ = prepare(RunConfig("mlp", plan=str(path), nproc=2, schedule="gpipe"), tmp_path)
    assert resolved.schedule == "gpipe"
    resolved, _, _ = prepare(RunConfig("mlp", plan=str(plans["mlp2"]), nproc=2), tmp_path)
    assert resolved.schedule == "gpipe"


def test_a_run_without_a_plan_plans_here_and_says_so_in_one_line(tmp_path: Path) -> None:
    """A profile made here has no call cost of the distributed runtime: the plan charges
    executor.GPipe's, and run() prints PLANNED_HERE (tests/app/test_restart.py sees it) instead
    of the planner's warning with its source line."""
    import warnings

    from autopipe.app.launch import NO_DISTRIBUTED_CALL_COST, prepare
    from autopipe.core.plan import Plan

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved, plan, where = prepare(RunConfig("mlp", nproc=2, batch_size=8, chunks=2), tmp_path)
    assert not [w for w in caught if NO_DISTRIBUTED_CALL_COST in str(w.message)]
    assert where == resolved.plan == str(tmp_path / "plan.json") and Plan.load(where).num_stages == 2


def _rank_trains(rank: int, config_json: str) -> tuple[list[float], dict[str, torch.Tensor], list[bool]]:
    """rank_main's loop on this rank: its losses, its stage's trained parameters (the original
    model's keys) and, per step, whether the grad scaler skipped the optimizer's step."""
    from autopipe.app import rank_main

    made: list[DistributedPipeline] = []
    skipped: list[bool] = []
    real_pipeline, real_scaler = rank_main.distributed_pipeline, rank_main.PipelineGradScaler  # type: ignore[attr-defined]

    def pipeline(*args: Any, **kwargs: Any) -> DistributedPipeline:
        made.append(real_pipeline(*args, **kwargs))
        return made[-1]

    class Scaler(real_scaler):  # type: ignore[misc, valid-type]
        def update(self, new_scale: Any = None) -> None:  # an overflow skips the step, halves the scale
            before = self.get_scale()
            super().update(new_scale)
            skipped.append(self.get_scale() < before)

    patch = pytest.MonkeyPatch()  # a pool rank runs other tests next: its module is put back
    patch.setattr(rank_main, "distributed_pipeline", pipeline)
    patch.setattr(rank_main, "PipelineGradScaler", Scaler)
    try:
        losses = rank_main.train(RunConfig.from_json(config_json))
    finally:
        patch.undo()
    (pipe,) = made
    trained = {k: v.detach().clone() for k, v in pipe.state_dict().items() if k != "_metadata"}
    return losses, trained, skipped


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_rank_trains_under_a_precision_with_clipping(plans: dict[str, Path], precision: str) -> None:
    """rank_main's loop on 2 ranks: autocast in the stages, fp16 through a PipelineGradScaler
    (scaled in the schedule, unscaled before clipping), the losses finite, each step's batch's
    ([Note: a batch per step]) and near the untrained fp32 model's on those batches (4 steps at
    lr 1e-3 move it little). What the steps did is the plain model's: trained here by the same
    steps (the same micro-batches' mean loss under the same autocast, torch's GradScaler under
    fp16, the same clipping and AdamW), it skips the steps the pipeline's scaler skipped, not all
    of them, reports the same losses, and its weights moved as the pipeline's did (up to the
    half-precision rounding that Adam's first, sign-like steps amplify)."""
    from tests.assemble.test_ranks import _ok, spawn

    config = RunConfig("mlp", plan=str(plans["mlp2"]), nproc=2, steps=4, threads=1, timeout=30,
                       batch_size=16, chunks=4,  # as the launcher resolves them from the plan
                       precision=precision, clip_grad=1.0)  # type: ignore[arg-type]
    (first, stage0, skipped0), (last, stage1, skipped1) = _ok(spawn(_rank_trains, config.to_json()))
    assert first == [] and len(last) == 4 and all(math.isfinite(v) for v in last)
    ex = autopipe.get_example("mlp", batch_size=16)
    initial = {k: v.clone() for k, v in ex.model.state_dict().items()}
    with torch.no_grad():
        plain = [float(ex.loss_fn(ex.model(*ex.batch(step)[0]), ex.batch(step)[1])) for step in range(4)]
    assert len(set(last)) == 4 and last == pytest.approx(plain, abs=0.1), (last, plain)

    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    opt = torch.optim.AdamW(ex.model.parameters(), lr=config.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")  # PipelineGradScaler's defaults
    losses, skipped = [], []
    for step in range(4):
        (x,), y = ex.batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.stack([ex.loss_fn(ex.model(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True)]).mean()
        losses.append(float(loss.detach()))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ex.model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
    assert skipped0 == skipped1 == skipped and not all(skipped), (skipped0, skipped1, skipped)
    assert last == pytest.approx(losses, abs=2e-3), (last, losses)
    trained = {**stage0, **stage1}
    assert set(trained) == set(initial)
    moved = torch.cat([(trained[k] - initial[k]).flatten() for k in initial])
    asked = torch.cat([(v - initial[k]).flatten() for k, v in ex.model.state_dict().items()])
    assert asked.norm() > 0 and float((moved - asked).norm() / asked.norm()) < 0.25
    for k, v in ex.model.state_dict().items():  # every layer moved, the way the plain one did
        assert float(torch.cosine_similarity((trained[k] - initial[k]).flatten(), (v - initial[k]).flatten(), 0)) > 0.95, k
