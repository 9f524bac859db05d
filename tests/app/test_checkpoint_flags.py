"""Checkpoints of `autopipe train` / `autopipe run` without a launch: each step's batch, the flags'
one-line refusals, a resume bit for bit in one process and on one rank, the fault hook's parser."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import autopipe
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.faults import parse
from autopipe.app.model_spec import load_model
from autopipe.app.run_checkpoints import PROGRESS
from autopipe.app.train import train_example
from autopipe.errors import BuildError
from autopipe.examples import EXAMPLES, get_example
from executor.checkpoint import load_checkpoint, save_checkpoint
from tests.assemble.test_ranks import one_rank  # noqa: F401 - a fixture


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_step_draws_its_own_batch_the_same_in_every_run(name: str) -> None:
    ex, again = get_example(name, 4), get_example(name, 4)
    assert ex.batch(0)[0] is ex.inputs and ex.batch(0)[1] is ex.target  # profiles and plans stay valid
    (x1, y1), (x1b, y1b), (x2, _) = ex.batch(1), again.batch(1), ex.batch(2)
    assert torch.equal(x1[0], x1b[0]) and torch.equal(y1, y1b)
    assert not torch.equal(x1[0], x2[0]) and not torch.equal(x1[0], ex.inputs[0])
    assert not torch.equal(x1[0], get_example(name, 4, seed=1).batch(1)[0][0])
    assert (x1[0].shape, x1[0].dtype, y1.shape, y1.dtype) == (ex.inputs[0].shape, ex.inputs[0].dtype,
                                                              ex.target.shape, ex.target.dtype)


def test_a_factory_keeps_its_one_batch_unless_it_brings_batch(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "step_batches_here.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom autopipe.examples import get_example\n\n"
        "def one(batch_size):\n"
        "    return torch.nn.Linear(4, 2), torch.randn(batch_size, 4), torch.zeros(batch_size).long(), F.cross_entropy\n\n"
        "def each(batch_size):\n"
        "    return get_example('mlp', batch_size)\n")
    monkeypatch.chdir(tmp_path)
    one = load_model("step_batches_here:one", 4, for_training="autopipe train")
    assert one.batch(3) == (one.inputs, one.target)
    each = load_model("step_batches_here:each", 4, for_training="autopipe train")
    assert torch.equal(each.batch(3)[0][0], get_example("mlp", 4).batch(3)[0][0])


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """1- and 2-stage mlp plans at batch 8 in 2 chunks."""
    ex = autopipe.get_example("mlp", batch_size=8)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=2, repeats=1, warmup=0)
    out = tmp_path_factory.mktemp("plans")
    return {k: autopipe.partition(prof, stages=k).save(out / f"mlp{k}.json") for k in (1, 2)}


@pytest.fixture
def mlp_plan(plans: dict[int, Path]) -> Path:
    return plans[2]


def _saved(folder: Path, name: str = "mlp", optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
           step: int = 2) -> Path:
    model = get_example(name, 8).model
    save_checkpoint(folder, model, optimizer(model.parameters(), lr=1e-3), step=step)
    return folder


def _refusals(tmp: Path) -> list[tuple[list[str], str]]:
    mlp, cnn, sgd = _saved(tmp / "mlp"), _saved(tmp / "cnn", "cnn"), _saved(tmp / "sgd", optimizer=torch.optim.SGD)
    (tmp / "empty").mkdir()
    return [
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir DIR, the folder checkpoints "
                                      "are saved in and resumed from; pass --checkpoint-dir"),
        (["--resume"], "--resume needs --checkpoint-dir DIR, the folder checkpoints are saved in and resumed "
                       "from; pass --checkpoint-dir"),
        (["--keep", "2"], "--keep needs --checkpoint-dir DIR, the folder checkpoints are saved in and resumed "
                          "from; pass --checkpoint-dir"),
        (["--checkpoint-dir", f"{tmp}/new", "--keep", "0"],
         "--keep 0 < 1: keep at least the newest checkpoint (--keep 1), or drop --keep to keep all"),
        (["--checkpoint-dir", f"{tmp}/new", "--checkpoint-every", "0"],
         "--checkpoint-every 0 < 1: save every N >= 1 steps, or drop it to save after the last step only"),
        (["--checkpoint-dir", f"{tmp}/missing", "--resume"],
         f"checkpoint '{tmp}/missing' does not exist; pass the folder given to save_checkpoint (or "
         "--checkpoint-dir), or one of its step-* folders"),
        (["--checkpoint-dir", f"{tmp}/empty", "--resume"],
         f"'{tmp}/empty' holds no checkpoint (no step-* folder with autopipe-checkpoint.json); pass the folder "
         "given to save_checkpoint (or --checkpoint-dir)"),
        (["--checkpoint-dir", str(cnn), "--resume"],
         f"checkpoint '{cnn}/step-00000002' is of another model: 16 of this model's tensors are not in it "
         "(net.0.weight, net.0.bias, net.2.weight, ...); load a checkpoint of this model"),
        (["--checkpoint-dir", str(sgd), "--resume"],
         f"checkpoint '{sgd}/step-00000002' holds SGD state but the optimizer is AdamW: pass a SGD, or load "
         "without the optimizer"),
        (["--checkpoint-dir", str(mlp)],
         f"--checkpoint-dir {mlp} already holds 1 checkpoint(s) (newest step-00000002); pass --resume to train "
         "on from it, or another --checkpoint-dir (nothing saved is overwritten)"),
    ]


def test_bad_checkpoint_flags_are_one_line_before_anything_runs(
        tmp_path: Path, mlp_plan: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", no_launch)
    for argv, line in _refusals(tmp_path):
        for command in ("train", "run"):
            assert main([command, "mlp", "--plan", str(mlp_plan), "--steps", "4", *argv]) == 2, (command, argv)
            assert capsys.readouterr().err == f"autopipe: error: {line}\n", (command, argv)
    assert main(["run", "mlp", "--max-restarts", "-1"]) == 2
    assert capsys.readouterr().err == ("autopipe: error: --max-restarts -1 < 0: pass 0 (a failed rank ends the "
                                       "run) or the number of restarts to allow\n")
    for command in ("train", "run"):  # already there: nothing to train, nothing started
        assert main([command, "mlp", "--plan", str(mlp_plan), "--steps", "2", "--checkpoint-dir",
                     str(tmp_path / "mlp"), "--resume"]) == 0
        assert capsys.readouterr().out.endswith(
            f"autopipe {command}: {tmp_path}/mlp{'/step-00000002' if command == 'run' else ''} is at step 2 of "
            "--steps 2: nothing left to train (pass a larger --steps to train on)\n")


def test_train_resumes_bit_for_bit(tmp_path: Path, mlp_plan: Path) -> None:
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train_example("mlp", plan=str(mlp_plan), steps=4, checkpoint_dir=str(whole), log=None)
    train_example("mlp", plan=str(mlp_plan), steps=3, checkpoint_dir=str(parts), checkpoint_every=1, keep=1,
                  log=None)
    assert sorted(p.name for p in parts.iterdir()) == [PROGRESS, "step-00000003"]
    (parts / PROGRESS).write_text(json.dumps({"step": 4}))  # as if step 4 had been cut short
    lines: list[str] = []
    report = train_example("mlp", plan=str(mlp_plan), steps=4, checkpoint_dir=str(parts), resume=True,
                           log=lines.append)
    assert report is not None and len(report.losses) == 1
    assert f"autopipe train: resumed from {parts}/step-00000003 at step 3 of 4; the run before had reached " \
           "step 4: step 4 runs again (1 redone)" in lines
    a, b = get_example("mlp", 8).model, get_example("mlp", 8).model
    assert load_checkpoint(whole, a).step == load_checkpoint(parts, b).step == 4
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), key


def plain_run(steps: int, batch: int = 8, chunks: int = 2, replicas: int = 1,
              lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """What an uninterrupted `autopipe run` of the mlp computes, bit for bit, in this process (one
    thread, as a rank runs): each replica's rows of each step's batch in micro-batches, their
    gradients summed and averaged over micro-batches and replicas, then AdamW."""
    ex = get_example("mlp", batch)
    params = list(ex.model.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    for step in range(steps):
        (x,), y = ex.batch(step)
        summed: list[torch.Tensor] = []
        for rows, labels in zip(x.tensor_split(replicas), y.tensor_split(replicas), strict=True):
            opt.zero_grad()
            for micro, target in zip(rows.tensor_split(chunks), labels.tensor_split(chunks), strict=True):
                ex.loss_fn(ex.model(micro), target).backward()
            grads = [p.grad.clone() for p in params if p.grad is not None]
            summed = [a + b for a, b in zip(summed, grads, strict=True)] if summed else grads
        for p, g in zip(params, summed, strict=True):
            p.grad = g / (replicas * chunks)
        opt.step()
    return ex.model.state_dict()


@pytest.mark.usefixtures("one_rank")
def test_a_restarted_rank_resumes_from_the_newest_checkpoint(
        tmp_path: Path, plans: dict[int, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from autopipe.app.rank_main import train

    folder = tmp_path / "ckpt"
    config = RunConfig("mlp", plan=str(plans[1]), nproc=1, steps=2, batch_size=8, chunks=2,
                       checkpoint_dir=str(folder), checkpoint_every=1)
    train(config)
    with pytest.raises(BuildError, match="already holds 2 checkpoint"):  # a fresh start, on a rank too
        train(config)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the group
    (folder / PROGRESS).write_text(json.dumps({"step": 3}))
    capsys.readouterr()
    losses = train(RunConfig.from_json(json.dumps({**json.loads(config.to_json()), "steps": 4})))
    out = capsys.readouterr().out
    assert out.startswith(f"autopipe run: restart 1: resumed from {folder}/step-00000002 at step 2 of 4; the "
                          "failed run had reached step 3: step 3 runs again (1 redone)\nstep    3/4  loss ")
    assert len(losses) == 2
    b = get_example("mlp", 8).model
    load_checkpoint(folder, b)
    for (key, x), y in zip(plain_run(4).items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), key


def test_the_fault_hook_parses_what_it_documents() -> None:
    faults = parse("rank=1,step=3,signal=KILL; rank=0,step=4,signal=stop,when=save,attempt=2;")
    assert [(f.rank, f.step, f.signal, f.when, f.attempt) for f in faults] == [
        (1, 3, "KILL", "step", 0), (0, 4, "STOP", "save", 2)]
    for bad in ("rank=1", "rank=1,step=3,signal=TERM", "rank=1,step=3,when=load", "rank=x,step=3",
                "rank=1,step=3,colour=red"):
        with pytest.raises(BuildError, match=r"^AUTOPIPE_FAULT=.*: each fault is rank=R,step=S"):
            parse(bad)
