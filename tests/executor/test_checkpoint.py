"""executor.checkpoint in one process: GPipe and the plain model, resume exactly, bad input.

Train 6 steps straight, or 3, save, build everything afresh (other RNG state), load and train 3
more: AdamW, a StepLR scheduler and dropout, the parameters and optimizer state equal bit for
bit under the same plan; under another plan (other K, the plain model) within assert_close, with
dropout off (its masks are drawn per micro-batch, so they differ between plans).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor import GPipe
from executor.checkpoint import checkpoint_info, dcp_io, load_checkpoint, save_checkpoint
from executor.errors import CheckpointError

CUTS = {1: [], 2: [3], 3: [2, 4]}


def _model(dropout: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(dropout), nn.ReLU(), nn.Linear(16, 16),
                         nn.Dropout(dropout / 2), nn.Linear(16, 4))


def _gpipe(model: nn.Sequential, k: int) -> GPipe:
    bounds = [0, *CUTS[k], len(model)]
    stages = [nn.Sequential(OrderedDict((str(i), model[i]) for i in range(a, b)))
              for a, b in zip(bounds, bounds[1:], strict=False)]
    return GPipe(stages, ["cpu"] * k, chunks=2)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


class Run:
    """A model (plain, or a GPipe of k stages) with AdamW and StepLR, trained step by step."""

    def __init__(self, k: int = 0, dropout: float = 0.2) -> None:
        self.model = _model(dropout)
        self.net: nn.Module = self.model if k == 0 else _gpipe(self.model, k)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)

    def train(self, steps: Iterable[int]) -> None:
        for step in steps:
            x, y = _batch(step)
            self.opt.zero_grad()
            F.mse_loss(self.net(x), y).backward()
            self.opt.step()
            self.sched.step()

    def save(self, path: Path, **kwargs: Any) -> Any:
        if isinstance(self.net, GPipe):
            return self.net.save_checkpoint(path, self.opt, self.sched, **kwargs)
        return save_checkpoint(path, self.net, self.opt, self.sched, step=kwargs.pop("step", 3), **kwargs)

    def load(self, path: Path) -> Any:
        if isinstance(self.net, GPipe):
            return self.net.load_checkpoint(path, self.opt, self.sched)
        return load_checkpoint(path, self.net, self.opt, self.sched).extra

    def optimizer_state(self) -> dict[str, Tensor]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {f"{names[id(p)]}.{k}": v for p, state in self.opt.state.items() for k, v in state.items()}


def _straight(k: int, dropout: float = 0.2) -> Run:
    torch.manual_seed(1)
    run = Run(k, dropout)
    run.train(range(6))
    return run


def _resumed(tmp_path: Path, saver: int, loader: int, dropout: float = 0.2) -> tuple[Run, Any]:
    torch.manual_seed(1)
    first = Run(saver, dropout)
    first.train(range(3))
    first.save(tmp_path, extra={"seen": 3 * 8})
    del first
    torch.manual_seed(12345)  # another process: another RNG state, restored by the load
    second = Run(loader, dropout)
    extra = second.load(tmp_path)
    second.train(range(3, 6))
    return second, extra


def _assert_same(a: Run, b: Run, exact: bool) -> None:
    check = (lambda x, y, msg: torch.testing.assert_close(x, y, rtol=0, atol=0, msg=msg)) if exact else (
        lambda x, y, msg: torch.testing.assert_close(x, y, msg=msg))
    for name, value in a.model.state_dict().items():
        check(b.model.state_dict()[name], value, name)
    sa, sb = a.optimizer_state(), b.optimizer_state()
    assert sorted(sa) == sorted(sb)
    for name, value in sa.items():
        check(sb[name], value, name)
    assert a.opt.param_groups[0]["lr"] == b.opt.param_groups[0]["lr"]
    assert a.sched.state_dict() == b.sched.state_dict()


@pytest.mark.parametrize("k", [0, 2])
def test_resume_under_the_same_plan_is_bit_for_bit(tmp_path: Path, k: int) -> None:
    resumed, extra = _resumed(tmp_path, k, k)
    assert extra == {"seen": 24}
    _assert_same(_straight(k), resumed, exact=True)
    if k:
        assert isinstance(resumed.net, GPipe) and resumed.net.steps == 6


@pytest.mark.parametrize(("saver", "loader"), [(2, 3), (3, 0), (0, 2)])
def test_resume_under_another_plan_or_the_plain_model(tmp_path: Path, saver: int, loader: int) -> None:
    resumed, _ = _resumed(tmp_path, saver, loader, dropout=0.0)
    _assert_same(_straight(loader, dropout=0.0), resumed, exact=False)


def test_folders_keep_and_info(tmp_path: Path) -> None:
    run = Run(2)
    for step in range(1, 5):
        run.train([step])
        run.save(tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    info = checkpoint_info(tmp_path)
    assert info["step"] == 4 and info["optimizer"] == "AdamW" and info["about"]["num_stages"] == 2
    assert Path(info["folder"]).name == "step-00000004"
    assert checkpoint_info(tmp_path / "step-00000003")["step"] == 3  # a step's folder by name


def test_a_crash_mid_save_leaves_the_previous_checkpoint_whole(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(2)
    run.train([0])
    run.save(tmp_path, step=1)

    def crash(state: Any, **kwargs: Any) -> None:
        Path(kwargs["checkpoint_id"], "__0_0.distcp").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_io, "dcp_save", crash)
    with pytest.raises(CheckpointError, match=r"step-00000002.*No space left.*previous checkpoints are untouched"):
        run.save(tmp_path, step=2)
    assert (tmp_path / "step-00000002.partial").is_dir()
    monkeypatch.undo()
    fresh = Run(2)
    fresh.load(tmp_path)  # the newest WHOLE step
    assert isinstance(fresh.net, GPipe) and fresh.net.steps == 1
    run.save(tmp_path, step=2)  # the stale partial folder is replaced
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]


def test_async_save_writes_the_state_of_the_call(tmp_path: Path) -> None:
    run = Run(2)
    run.train([0])
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert isinstance(run.net, GPipe)
    pending = run.net.save_checkpoint(tmp_path, run.opt, async_save=True)
    run.train([1])  # training goes on while the checkpoint is written
    assert pending.wait() == tmp_path / "step-00000001"
    assert pending.done()
    plain = _model()
    load_checkpoint(tmp_path, plain)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, before[name]), name


# --- bad input: one line each, nothing saved is changed -----------------------------------------
def _one_line(err: pytest.ExceptionInfo[CheckpointError]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_bad_folders(tmp_path: Path) -> None:
    run = Run(2)
    with pytest.raises(CheckpointError) as err:
        run.load(tmp_path / "missing")
    assert "does not exist" in _one_line(err)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        run.load(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        run.load(tmp_path / "file")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "step-00000005.partial").mkdir()
    with pytest.raises(CheckpointError, match="did not finish"):
        run.load(tmp_path / "only")
    with pytest.raises(CheckpointError, match="keep=0"):
        run.save(tmp_path / "new", keep=0)
    with pytest.raises(CheckpointError, match="plain data"):
        run.save(tmp_path / "new", extra={"f": lambda: 1})
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


def test_another_model_names_the_first_keys(tmp_path: Path) -> None:
    run = Run(2)
    run.save(tmp_path)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, other)
    text = _one_line(err)
    assert "is of another model" in text and "shapes differ for 0.weight (checkpoint (16, 8), model (32, 8))" in text
    bigger = nn.Sequential(*_model(), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"2 of this model's tensors are not in it \(6.weight, 6.bias\)"):
        load_checkpoint(tmp_path, bigger)
    smaller = nn.Sequential(*list(_model())[:4])
    with pytest.raises(CheckpointError, match=r"2 of its tensors are not in this model \(5.bias, 5.weight\)"):
        load_checkpoint(tmp_path, smaller)


def test_another_optimizer_or_none(tmp_path: Path) -> None:
    run = Run(2)
    run.train([0])
    run.save(tmp_path / "adamw")
    model = _model()
    with pytest.raises(CheckpointError, match="holds AdamW state but the optimizer is SGD: pass a AdamW"):
        load_checkpoint(tmp_path / "adamw", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(run.net, GPipe)
    run.net.save_checkpoint(tmp_path / "bare")
    with pytest.raises(CheckpointError, match="saved without an optimizer"):
        load_checkpoint(tmp_path / "bare", model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match="not one of this pipeline's"):
        run.net.save_checkpoint(tmp_path / "x", torch.optim.AdamW(nn.Linear(2, 2).parameters()))


def test_truncated_or_corrupt_parts(tmp_path: Path) -> None:
    run = Run(2)
    run.train([0])
    folder = run.save(tmp_path).wait()
    part = folder / "__0_0.distcp"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"part __0_0.distcp has {len(data) // 2} bytes of {len(data)}"):
        run.load(folder)
    part.unlink()
    with pytest.raises(CheckpointError, match="part __0_0.distcp is missing"):
        run.load(tmp_path)
    (folder / "autopipe-checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable or corrupt"):
        run.load(folder)
    manifest = {"format": 1, "step": 1, "world": 1, "files": {}}
    (folder / "autopipe-checkpoint.json").write_text(json.dumps(manifest))
    (folder / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable"):
        run.load(folder)
