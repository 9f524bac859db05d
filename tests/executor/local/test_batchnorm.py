from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor.local.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm
from executor.local.gpipe import GPipe
from executor.recompute import _flag, is_recomputing
from tests.models import BNNet


class BNFront(nn.Module):
    def __init__(self, model: BNNet) -> None:
        super().__init__()
        self.c1, self.bn1 = model.c1, model.bn1

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn1(self.c1(x)))


class BNBack(nn.Module):
    def __init__(self, model: BNNet) -> None:
        super().__init__()
        self.c2, self.bn2, self.head = model.c2, model.bn2, model.head

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn2(self.c2(x)))
        out: Tensor = self.head(x.mean(dim=(2, 3)))
        return out


STATS = ["running_mean", "running_var", "num_batches_tracked"]


def _stats(module: nn.Module) -> dict[str, Tensor]:
    return {k: v for k, v in module.state_dict().items() if k.split(".")[-1] in STATS}


def _bn_pipe(deferred: bool, mode: str = "always") -> tuple[GPipe, BNNet]:
    model = BNNet()
    ref = copy.deepcopy(model)
    pipe = GPipe(
        [BNFront(model), BNBack(model)],
        ["cpu", "cpu"],
        chunks=4,
        recompute=mode,
        deferred_batch_norm=deferred,
    )
    return pipe, ref


def test_deferred_running_stats_match_plain_model_after_a_step() -> None:
    """bn1 sees the same inputs as in the plain model: its running statistics must match it
    exactly. bn2's inputs were normalised by bn1 per micro-batch (inherent to micro-batching),
    so it must match one plain BatchNorm update over exactly the inputs it saw."""
    pipe, ref = _bn_pipe(deferred=True)
    bn2 = pipe.stages[1].bn2
    plain_bn2 = copy.deepcopy(ref.bn2)
    seen: list[Tensor] = []
    bn2.register_forward_pre_hook(
        lambda m, args: None if is_recomputing() else seen.append(args[0].detach())
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x = torch.randn(8, 3, 6, 6)
    opt.zero_grad()
    pipe(x).pow(2).mean().backward()  # with recomputation, which must not be tracked again
    opt.step()
    ref(x)
    plain_bn2(torch.cat(seen))
    got, want = _stats(pipe), _stats(ref)
    assert list(got) == list(want)
    for key in ("bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"):
        torch.testing.assert_close(got[key], want[key], msg=key)
    for key, value in _stats(plain_bn2).items():
        torch.testing.assert_close(got["bn2." + key], value, msg=key)
    assert len(seen) == 4
    assert bn2.count == 0 and pipe.stages[0].bn1.count == 0  # recomputation tracked nothing


def test_without_deferral_running_stats_drift() -> None:
    pipe, ref = _bn_pipe(deferred=False)
    x = torch.randn(8, 3, 6, 6)
    pipe(x)
    ref(x)
    assert int(_stats(pipe)["bn1.num_batches_tracked"]) == 4  # one update per micro-batch
    assert not torch.allclose(_stats(pipe)["bn1.running_var"], _stats(ref)["bn1.running_var"])


def test_eval_uses_running_stats_and_matches_plain_model() -> None:
    pipe, ref = _bn_pipe(deferred=True)
    x = torch.randn(8, 3, 6, 6)
    pipe(x)
    ref(x)
    ref.load_state_dict(pipe.state_dict())
    pipe.eval()
    ref.eval()
    torch.testing.assert_close(pipe(x), ref(x))  # eval: running statistics, per micro-batch
    assert int(_stats(pipe)["bn1.num_batches_tracked"]) == 1


def test_conversion_shares_parameters_and_buffers() -> None:
    model = BNNet()
    weight, mean = model.bn1.weight, model.bn1.running_mean
    converted, layers = convert_deferred_batch_norm(model)
    assert converted is model and len(layers) == 2
    assert isinstance(model.bn1, DeferredBatchNorm)
    assert model.bn1.weight is weight and model.bn1.running_mean is mean
    assert sorted(model.state_dict()) == sorted(BNNet().state_dict())  # no extra keys
    bn = nn.BatchNorm1d(3)
    alone, found = convert_deferred_batch_norm(bn)
    assert isinstance(alone, DeferredBatchNorm) and found == [alone]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_commit_equals_one_batch_norm_update(momentum: float | None) -> None:
    bn = nn.BatchNorm1d(3, momentum=momentum)
    deferred, _ = convert_deferred_batch_norm(copy.deepcopy(bn))
    assert isinstance(deferred, DeferredBatchNorm)
    x = torch.randn(10, 3) * 3 + 1
    bn(x)
    for part in torch.tensor_split(x, 3):
        deferred(part)
    with _flag("recomputing"):
        deferred(x[:2])  # recomputation is not tracked
    deferred.commit()
    torch.testing.assert_close(deferred.running_mean, bn.running_mean)
    torch.testing.assert_close(deferred.running_var, bn.running_var)
    assert deferred.count == 0
    deferred.commit()  # nothing tracked: no update
    assert int(deferred.num_batches_tracked) == 1


def test_input_rank_checked() -> None:
    with pytest.raises(ValueError, match="expected at least 2D input"):
        DeferredBatchNorm(3)(torch.randn(3))
