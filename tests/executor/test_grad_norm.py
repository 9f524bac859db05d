"""GPipe.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the plain model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from executor.errors import ExecutorError
from executor.grad_norm import NonFiniteNormError
from executor.local.gpipe import GPipe
from tests.conftest import skip_if_no_cuda
from tests.executor.local.test_gpipe import Steps, Tied, _tied_stages, chain_stages
from tests.executor.local.test_placement import TiedEnds
from tests.models import Chain


def _backward(pipe: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    pipe(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()


def _assert_clipped_alike(pipe: GPipe, model: nn.Module, ref: nn.Module, max_norm: float,
                          norm_type: float) -> None:
    """The pipeline's norm is torch's on ``ref``, and ``model`` (whose parameters the stages
    hold) has ``ref``'s clipped gradients."""
    norm = pipe.clip_grad_norm_(max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    assert_close(norm, expected)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_norm_and_clipped_grads_equal_the_plain_models(norm_type: float) -> None:
    model = Chain()
    ref = copy.deepcopy(model)
    pipe = GPipe(chain_stages(model, 3), ["cpu"] * 3, chunks=2)
    _backward(pipe, ref, torch.randn(4, 8))
    _assert_clipped_alike(pipe, model, ref, 0.01, norm_type)  # clips: every gradient scaled
    before = [p.grad.clone() for p in ref.parameters()]  # type: ignore[union-attr]
    _assert_clipped_alike(pipe, model, ref, 1e6, norm_type)  # does not clip: nothing moves
    assert all(torch.equal(b, p.grad) for b, p in zip(before, ref.parameters(), strict=True))


def test_a_tied_parameter_on_two_stages_counts_once() -> None:
    model = Tied()  # a.weight and a.bias used by both stages
    ref = copy.deepcopy(model)
    pipe = GPipe(_tied_stages(model), ["cpu", "cpu"], chunks=2)
    _backward(pipe, ref, torch.randn(4, 4))
    _assert_clipped_alike(pipe, model, ref, 0.01, 2.0)


def _tied_ends_stages(model: TiedEnds) -> list[nn.Module]:
    """The embedding's stage, then the head's: one weight, two modules (a GPT's tie)."""
    return [Steps(model, ["emb", "mid"], [lambda m, x: torch.tanh(m.mid(m.emb(x)))]),
            Steps(model, ["head"], [lambda m, x: m.head(x)])]


@pytest.mark.parametrize("devices", [("cuda", "cpu"), ("cpu", "cuda")])
@skip_if_no_cuda
def test_a_tied_parameter_across_devices_counts_once(devices: tuple[str, str]) -> None:
    # the weight lives on the first stage's device and the head fetches a copy
    # ([Note: ties across devices]): the norm counts it once, and its one gradient is the sum
    # of both uses, as in the plain model on the CPU
    model = TiedEnds()
    ref = copy.deepcopy(model)
    pipe = GPipe(_tied_ends_stages(model), list(devices), chunks=2)
    x = torch.randn(4, 4)
    pipe(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    norm = pipe.clip_grad_norm_(0.01)
    assert_close(norm.cpu(), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert_close(q.grad.cpu(), p.grad, msg=name)  # type: ignore[union-attr]


def test_a_nonfinite_norm_is_one_line_when_asked_and_clipped_through_otherwise() -> None:
    model = Chain()
    ref = copy.deepcopy(model)
    pipe = GPipe(chain_stages(model, 2), ["cpu"] * 2, chunks=2)
    _backward(pipe, ref, torch.randn(4, 8))
    for m in (model, ref):
        m.net[0].weight.grad[0, 0] = math.inf  # type: ignore[index]
    with pytest.raises(NonFiniteNormError, match=r"^the total gradient norm of order 2.0 is inf") as err:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, RuntimeError)  # what torch raises: except RuntimeError still works
    assert model.net[2].weight.grad.isfinite().all()  # type: ignore[union-attr]  # nothing scaled
    assert_close(pipe.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert_close(q.grad, p.grad, equal_nan=True)


def test_a_parameter_without_a_gradient_counts_nothing_and_bad_norms_are_one_line() -> None:
    pipe = GPipe(chain_stages(Chain(), 2), ["cpu"] * 2, chunks=2)
    assert_close(pipe.clip_grad_norm_(1.0), torch.tensor(0.0))
    for bad in (0, -1.0, -math.inf, math.nan):
        with pytest.raises(ExecutorError, match=r"^norm_type=.* is not a norm .*float\('inf'\)$"):
            pipe.clip_grad_norm_(1.0, bad)
