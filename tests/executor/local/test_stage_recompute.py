"""executor.GPipe with one recompute mode per stage ([Note: per-stage recomputation]).

Each stage recomputes exactly the micro-batches executor.spec.recomputed_microbatches gives its
own mode, whatever its neighbours do, and any mix of modes leaves the plain model's loss and
gradients (and, with deferred BatchNorm, its running statistics).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from executor.errors import ExecutorError
from executor.local.gpipe import GPipe
from executor.recompute import is_checkpointing, is_recomputing
from executor.spec import check_stage_recompute, recomputed_microbatches
from tests.executor.local.test_batchnorm import BNBack, BNFront
from tests.executor.local.test_gpipe import _run, skip_stages
from tests.models import BNNet, Skip

MIXES = [
    ["always", "never", "except_last"],
    ["never", "always", "never"],
    ["except_last", "except_last", "always"],
]
CHUNKS = 4


def _assert_same_grads(model: nn.Module, ref: nn.Module) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=f"gradient of {name}")


@pytest.mark.parametrize("modes", MIXES)
def test_skip_model_with_per_stage_modes_matches_unpipelined(modes: list[str]) -> None:
    torch.manual_seed(0)
    model = Skip()
    ref = copy.deepcopy(model)
    pipe = GPipe(skip_stages(model, 3), ["cpu"] * 3, chunks=CHUNKS, recompute=modes)
    assert pipe.recompute_modes == modes
    x = torch.randn(10, 8)  # 3 + 3 + 2 + 2: uneven micro-batches
    _run(pipe, ref, x)  # output, loss and every gradient against the deep copy


class Tagged(nn.Module):
    """A Linear over all columns but the last, which carries each row's index down the chain,
    so every call knows its micro-batch; records (micro-batch, phase) per call."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.rows = rows
        self.calls: list[tuple[int, str]] = []

    def forward(self, x: Tensor) -> Tensor:
        phase = ("recompute" if is_recomputing() else
                 "checkpointed" if is_checkpointing() else "plain")
        self.calls.append((int(x[0, -1].item()) // self.rows, phase))
        return torch.cat([self.inner(x[:, :-1]), x[:, -1:]], dim=1)


def _tagged(modes: list[str]) -> tuple[GPipe, list[Tagged], Tensor]:
    stages = [Tagged(rows=2) for _ in modes]
    x = torch.cat([torch.randn(2 * CHUNKS, 4), torch.arange(2.0 * CHUNKS)[:, None]], dim=1)
    return GPipe(stages, ["cpu"] * len(modes), chunks=CHUNKS, recompute=modes), stages, x


def _by_phase(stage: Tagged) -> dict[str, list[int]]:
    return {phase: sorted(i for i, p in stage.calls if p == phase)
            for phase in ("plain", "checkpointed", "recompute")}


@pytest.mark.parametrize("modes", MIXES)
def test_each_stage_recomputes_the_microbatches_its_mode_says(modes: list[str]) -> None:
    pipe, stages, x = _tagged(modes)
    pipe(x).pow(2).sum().backward()
    for s, (mode, stage) in enumerate(zip(modes, stages, strict=True)):
        r = recomputed_microbatches(mode, CHUNKS)
        assert _by_phase(stage) == {
            "plain": list(range(r, CHUNKS)),  # kept their activations
            "checkpointed": list(range(r)),  # ran without them ...
            "recompute": list(range(r)),  # ... and were recomputed once in backward
        }, f"stage {s} ({mode})"
        assert len(stage.calls) == CHUNKS + r
        assert stage.inner.weight.grad is not None


def test_no_recomputation_in_eval_or_under_no_grad() -> None:
    modes = ["always", "except_last", "always"]
    pipe, stages, x = _tagged(modes)
    pipe.eval()
    pipe(x.requires_grad_()).sum().backward()  # eval with grad: plain autograd
    pipe.train()
    with torch.no_grad():
        assert not pipe(x).requires_grad
    for stage in stages:
        assert _by_phase(stage) == {"plain": sorted(list(range(CHUNKS)) * 2),
                                    "checkpointed": [], "recompute": []}


STATS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.mark.parametrize("modes", [["always", "never"], ["never", "except_last"]])
def test_deferred_batch_norm_per_stage(modes: list[str]) -> None:
    """Outputs and gradients equal the model run micro-batch by micro-batch (each micro-batch
    normalised by its own statistics); running statistics advance once, with the statistics
    of the whole mini-batch as each BatchNorm saw it (bn1: exactly the plain model's)."""
    torch.manual_seed(0)
    model = BNNet()
    per_microbatch, plain = copy.deepcopy(model), copy.deepcopy(model)
    plain_bn2 = copy.deepcopy(model.bn2)
    pipe = GPipe([BNFront(model), BNBack(model)], ["cpu", "cpu"], chunks=CHUNKS,
                 recompute=modes, deferred_batch_norm=True)
    seen: dict[str, list[Tensor]] = {"bn1": [], "bn2": []}
    for j, name in enumerate(seen):
        bn = getattr(pipe.stages[j], name)
        bn.register_forward_pre_hook(
            lambda m, args, name=name: None if is_recomputing() else seen[name].append(args[0])
        )
    x = torch.randn(8, 3, 6, 6)
    out = pipe(x)
    out.pow(2).mean().backward()
    ref_out = torch.cat([per_microbatch(xi) for xi in x.tensor_split(CHUNKS)])
    ref_out.pow(2).mean().backward()
    torch.testing.assert_close(out, ref_out)
    _assert_same_grads(model, per_microbatch)
    assert [len(v) for v in seen.values()] == [CHUNKS, CHUNKS]  # tracked once per micro-batch
    plain(x)
    plain_bn2(torch.cat(seen["bn2"]).detach())
    for stat in STATS:
        torch.testing.assert_close(getattr(model.bn1, stat), getattr(plain.bn1, stat), msg=stat)
        torch.testing.assert_close(getattr(model.bn2, stat), getattr(plain_bn2, stat), msg=stat)
    assert model.bn1.num_batches_tracked is not None and int(model.bn1.num_batches_tracked) == 1


@pytest.mark.parametrize(
    ("recompute", "match"),
    [
        (["always", "never"], r"recompute lists 2 mode\(s\) for 3 stage\(s\); give one mode per "
                              r"stage, or one mode for all of them"),
        (["always", "sometimes", "never"], r"recompute\[1\]='sometimes' is not a recompute "
                                           r"mode; use one of always, except_last, never"),
        ([None, "never", "never"], r"recompute\[0\]=None is not a recompute mode"),
        (3, r"recompute=3 is neither a mode nor a list of modes"),
        ("sometimes", r"recompute='sometimes' is not a recompute mode"),
    ],
)
def test_bad_per_stage_modes_end_in_one_line(recompute: Any, match: str) -> None:
    with pytest.raises(ExecutorError, match=match) as err:
        GPipe([nn.Linear(2, 2) for _ in range(3)], ["cpu"] * 3, chunks=2, recompute=recompute)
    assert "\n" not in str(err.value)


def test_check_stage_checkpoints_expands_one_mode() -> None:
    assert check_stage_recompute("never", 3) == ["never"] * 3
    assert check_stage_recompute(("always", "never"), 2) == ["always", "never"]
    pipe = GPipe([nn.Linear(2, 2)] * 1, ["cpu"], chunks=2, recompute="always")
    assert pipe.recompute == "always" and pipe.recompute_modes == ["always"]
