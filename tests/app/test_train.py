from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import autopipe
import autopipe.app.rank_main
import autopipe.app.train
from autopipe import AutopipeError, PlanError
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.train import TrainReport, train_example
from autopipe.core.plan import Plan
from autopipe.solvers.synthetic import random_chain
from tests.assemble.test_ranks import one_rank  # noqa: F401 - a fixture


def test_trains_a_bundled_example_end_to_end() -> None:
    lines: list[str] = []
    report = train_example("mlp", stages=2, chunks=4, batch_size=16, steps=4, lr=1e-2,
                           log=lines.append)
    assert report is not None and len(report.plan.stages) == 2 and report.devices == ["cpu", "cpu"]
    # each step trains on its own batch ([Note: a batch per step]), as the unpipelined model does
    ex = autopipe.get_example("mlp", batch_size=16)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-2)
    plain = []
    for step in range(4):
        (x,), y = ex.batch(step)
        opt.zero_grad()
        loss = ex.loss_fn(ex.model(x), y)
        loss.backward()
        opt.step()
        plain.append(loss.item())
    assert report.losses == pytest.approx(plain, rel=1e-4) and len(set(report.losses)) == 4
    assert report.median_step_ms > 0 and report.baseline_ms > 0 and report.predicted_ms > 0
    assert len(report.optimizer_ms) == 4 and 0 < report.median_forward_backward_ms < report.median_step_ms
    # stages sharing one CPU take turns: the shared prediction is the slower one
    assert report.predicted_apart_ms < report.predicted_ms
    summary = report.summary()
    # the split the default takes: the DP's, or a faster step's (measured times decide)
    assert re.match(r"mlp: batch 16 in 4 micro-batches of 4 rows, 2 stages on cpu, cpu "
                    r"\(recompute=except_last, method=(exact|step)\)\n", summary), summary
    assert "measured/predicted" in summary and "pipelined/unpipelined" in summary
    assert "Stages on one device take turns: with 2 stages on cpu" in summary
    assert "`autopipe run mlp --nproc 2 --batch-size 16 --chunks 4`" in summary
    assert any(line.startswith("step 4/4") for line in lines) and lines[-1] == summary


def test_summary_without_shared_devices_claims_no_turn_taking() -> None:
    prof = random_chain(4, 0)
    plan = Plan.from_stages(prof, [prof.layers[:2], prof.layers[2:]], chunks=2)
    report = TrainReport("toy", plan, losses=[2.0, 1.0], step_ms=[9.0, 5.0], optimizer_ms=[1.0, 1.0],
                         baseline_ms=8.0, batch_size=6, devices=["cuda:0", "cuda:1"],
                         predicted_ms=2.0, predicted_apart_ms=2.0)
    lines = report.summary().splitlines()
    assert lines[0] == "toy: batch 6 in 2 micro-batches of 3 rows, 2 stages on cuda:0, cuda:1 " \
                       "(recompute=except_last, method=manual)"
    assert lines[2].startswith("step 5.0 ms (medians of steps 2..2: forward+backward 4.0 ms, AdamW 1.0 ms)")
    assert "(measured/predicted 2.00)" in lines[2] and "(pipelined/unpipelined 0.62)" in lines[2]
    assert len(lines) == 3 and "take turns" not in report.summary()


def test_cli_train_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "unet", "--stages", "2", "--chunks", "2", "--batch-size", "4",
                 "--steps", "2"]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"^step (\d+/\d+)  loss (\S+)", out, flags=re.M)
    assert [s for s, _ in steps] == ["1/2", "2/2"] and all(math.isfinite(float(v)) for _, v in steps)
    assert "unet: batch 4 in 2 micro-batches of 2 rows, 2 stages on cpu, cpu" in out
    assert "measured/predicted" in out and "autopipe run unet --nproc 2 --batch-size 4 --chunks 2" in out
    for argv, line in [
        (["nope"], "autopipe: error: model 'nope' is neither a bundled example (cnn, gpt, mlp, unet) nor "
                   "'package.module:factory'; pass e.g. 'mlp' or 'mypkg.models:make_model'"),
        (["mlp", "--stages", "2", "--devices", "cpu"],
         "autopipe: error: 1 devices for 2 stages: pass one device per stage (--devices) or --stages 1"),
        (["mlp", "--batch-size", "2", "--chunks", "4"],
         "autopipe: error: chunks=4 > batch size 2: micro-batches would be empty; use chunks <= 2"),
        (["tests.models:make_chain"],
         "autopipe: error: factory 'tests.models:make_chain' returned no inputs, target and loss function, "
         "which autopipe train needs; return (model, inputs, target, loss_fn) or an object with .model, "
         ".inputs, .target and .loss_fn (like autopipe.examples.Example)"),
    ]:
        assert main(["train", *argv]) == 2
        assert capsys.readouterr().err == line + "\n"


def test_cli_train_clips_with_the_pipelines_norm(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "mlp", "--stages", "2", "--chunks", "2", "--batch-size", "4", "--steps", "2",
                 "--clip-grad", "1e-3", "--recompute", "never"]) == 0
    out = capsys.readouterr().out
    norms = [float(v) for v in re.findall(r"^step \d/2  loss \S+  grad norm (\S+)  ", out, flags=re.M)]
    assert "2 stages on cpu, cpu (recompute=never, " in out  # the word of the library and the plan
    assert len(norms) == 2 and all(v > 1e-3 for v in norms)  # each step's norm, then clipped
    report = train_example("mlp", stages=2, chunks=2, batch_size=4, steps=1, clip_grad=1e-3, log=None)
    assert report is not None and len(report.grad_norms) == 1
    assert main(["train", "mlp", "--clip-grad", "-1"]) == 2
    assert capsys.readouterr().err == ("autopipe: error: --clip-grad -1.0 must be > 0 (the largest gradient "
                                       "norm a step keeps), e.g. --clip-grad 1.0\n")


def test_train_takes_sizes_from_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ex = autopipe.get_example("mlp", batch_size=12)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=3, repeats=1, warmup=0)
    plan_path = tmp_path / "mlp3.json"
    autopipe.partition(prof, stages=3).save(plan_path)
    # the plan was made for 3 devices (cpu:0 .. cpu:2); train runs the stages on one CPU
    with pytest.warns(UserWarning, match=r"the plan was made for devices \['cpu:0', 'cpu:1', "
                                         r"'cpu:2'\] but the pipeline runs on \['cpu', 'cpu', 'cpu'\]"):
        assert main(["train", "mlp", "--plan", str(plan_path), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "mlp: batch 12 in 3 micro-batches of 4 rows, 3 stages on cpu, cpu, cpu" in out
    assert f"`autopipe run mlp --nproc 3 --batch-size 12 --chunks 3 --plan {plan_path}`" in out
    assert main(["train", "mlp", "--plan", str(plan_path), "--stages", "2"]) == 2
    assert capsys.readouterr().err == ("autopipe: error: --stages 2 but the plan has 3 stages; drop --stages "
                                       "(it defaults to the plan's) or re-run `autopipe partition --stages 2`\n")


def test_train_a_factory_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train_factory_here.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom tests.models import Chain\n\n"
        "def make(batch_size):\n"
        "    return Chain(), torch.randn(batch_size, 8), torch.randint(0, 4, (batch_size,)), F.cross_entropy\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "train_factory_here", raising=False)
    assert main(["train", "train_factory_here:make", "--batch-size", "8", "--chunks", "2", "--steps", "2"]) == 0
    assert "make: batch 8 in 2 micro-batches of 4 rows, 2 stages on cpu, cpu" in capsys.readouterr().out


def test_bad_arguments() -> None:
    with pytest.raises(AutopipeError, match=r"steps=0 < 1: train at least one step \(--steps 1 or more\)"):
        train_example("mlp", steps=0, log=None)
    with pytest.raises(PlanError, match="does not exist"):
        train_example("mlp", plan="does/not/exist.json", log=None)


def test_cli_precision_reaches_the_pipeline(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    built: list[str] = []
    real = autopipe.app.train.pipeline

    def spy(*args: Any, **kwargs: Any) -> Any:
        pipe = real(*args, **kwargs)
        built.append(pipe.precision)
        return pipe

    monkeypatch.setattr(autopipe.app.train, "pipeline", spy)
    assert main(["train", "mlp", "--stages", "2", "--chunks", "2", "--batch-size", "4", "--steps", "1",
                 "--precision", "bf16"]) == 0
    assert built == ["bf16"]
    out = capsys.readouterr().out
    assert re.search(r"\(recompute=except_last, method=(exact|step), precision=bf16\)", out), out
    assert "--chunks 2 --precision bf16`" in out  # the autopipe run command it names
    for command in ("train", "run"):
        assert main([command, "mlp", "--precision", "fp8"]) == 2
        assert capsys.readouterr().err == ("autopipe: error: --precision 'fp8' is unknown; use one of "
                                           "['fp32', 'bf16', 'fp16']\n")


class _Built(Exception):
    pass


@pytest.mark.usefixtures("one_rank")
def test_run_passes_precision_to_every_ranks_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    def spy(*args: object, **kwargs: object) -> None:
        seen.append(kwargs["precision"])
        raise _Built

    monkeypatch.setattr(autopipe.app.rank_main, "distributed_pipeline", spy)
    config = RunConfig.from_json(RunConfig("mlp", nproc=1, steps=1, batch_size=8, chunks=2,
                                           precision="bf16").to_json())  # as a rank reads it
    with pytest.raises(_Built):
        autopipe.app.rank_main.train(config)
    assert seen == ["bf16"]
