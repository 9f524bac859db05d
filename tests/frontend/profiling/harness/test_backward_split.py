"""[Note: split backward measured]: each layer's backward in torch's two halves, in every way
autopipe profiles (a whole run, layer by layer on a meta model, under a precision)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import autopipe
from autopipe.core.profile_table import Profile
from autopipe.examples import TinyGPT
from autopipe.frontend.profiling.harness.backward_split import (
    BackwardSplit,
    input_share,
    measure_split,
)
from autopipe.frontend.profiling.harness.replay import LayerCall, Values
from autopipe.frontend.profiling.harness.timing import CpuTimer
from tests.frontend.profiling.counted import CLOCK, Cost, CountedChain
from tests.models import Chain

FAST = dict(repeats=1, warmup=0, progress=False)


def _check_split(prof: Profile) -> None:
    df = prof.df
    assert (df["bwd_input_ms"] + df["bwd_weight_ms"] - df["bwd_ms"]).abs().max() < 1e-5
    assert (df[["bwd_input_ms", "bwd_weight_ms", "weight_grad_bytes"]] >= 0).all().all()
    assert isinstance(prof.meta["bwd_split_ratio"], float)


def test_a_whole_run_splits_each_layers_backward() -> None:
    model, x = Chain((8, 32, 32, 4)), torch.randn(8, 8)  # Linear, ReLU, Linear, ReLU, Linear
    prof = autopipe.profile(model, (x,), chunks=2, **FAST)
    _check_split(prof)
    rows = prof.df.set_index("layer")
    first, relu, linear = rows.iloc[0], rows.iloc[1], rows.iloc[2]
    # the model's input needs no gradient: torch runs the first stage's whole backward as W
    assert first["bwd_input_ms"] == 0.0 and first["weight_grad_bytes"] == 0
    assert relu["bwd_weight_ms"] == 0.0 and relu["weight_grad_bytes"] == 0  # no weights
    # a Linear's weight pass starts from its output's gradient: 4 rows x 32 floats
    assert linear["weight_grad_bytes"] == 4 * 32 * 4
    assert Profile.from_frame(prof.df).df["weight_grad_bytes"].equals(prof.df["weight_grad_bytes"])


@pytest.mark.parametrize("mode", ["whole", "layers"])
def test_halves_of_known_length_give_the_split_and_its_ratio(mode: str) -> None:
    # declared ms (tests/frontend/profiling/counted.py): b's backward is 5 ms for its input's
    # gradient, then 2 for its weight's; a's input (the model's) needs no gradient, so its
    # backward is its weight's 1 ms, all of it W. Split or whole, the halves take what the
    # whole does: the ratio is 1
    a, b = Cost(2.0, 2.0, 0.0, 3.0, 1.0), Cost(6.0, 6.0, 0.0, 5.0, 2.0)
    prof = autopipe.profile(CountedChain(a, b), (torch.randn(8, 4),), chunks=2, repeats=3, warmup=1, mode=mode,
                            timer=CpuTimer(clock=CLOCK), progress=False)
    _check_split(prof)
    assert list(prof.df["bwd_input_ms"]) == pytest.approx([0.0, 5.0])
    assert list(prof.df["bwd_weight_ms"]) == pytest.approx([1.0, 2.0])
    assert prof.meta["bwd_split_ratio"] == pytest.approx(1.0)


def test_layer_by_layer_on_a_meta_model_and_under_a_precision() -> None:
    with torch.device("meta"):
        model = TinyGPT(layers=2)
    ids = torch.randint(0, 256, (2, 16))
    prof = autopipe.profile(model, (ids,), mode="layers", **FAST)
    _check_split(prof)
    reused = prof.df[prof.df["measured_as"] != prof.df["layer"]]
    assert len(reused) > 0  # a twin carries its source's share and bytes
    source = prof.df.set_index("layer").loc[reused["measured_as"]]
    assert list(reused["weight_grad_bytes"]) == list(source["weight_grad_bytes"])
    bf16 = autopipe.profile(Chain((8, 16, 4)), (torch.randn(4, 8),), precision="bf16", **FAST)
    _check_split(bf16)
    # the gradient a bf16 matmul's weight pass starts from is bf16: 4 rows x 4 x 2 bytes
    assert bf16.df["weight_grad_bytes"].iloc[-1] == 4 * 4 * 2


class _Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.proj(x)
        return h[:, :8], h[:, 8:]  # views of one output


def test_a_layer_returning_views_splits_too() -> None:
    module = fx.symbolic_trace(_Halves())
    call = LayerCall("halves", module, ["x"], ["a", "b"])
    split = measure_split(call, Values({"x": torch.randn(4, 8, requires_grad=True)}), CpuTimer())
    assert split is not None and split.input_ms > 0 and split.weight_ms > 0
    assert split.weight_grad_bytes == 4 * 16 * 4  # the projection's output gradient
    assert module.proj.weight.grad is not None  # the weight pass reached the weights


def test_the_input_share() -> None:
    assert input_share(BackwardSplit(3.0, 1.0, 0, True), (1.0, 0.0)) == pytest.approx(2 / 3)
    assert input_share(BackwardSplit(0.0, 2.0, 0, True), (1.0, 1.0)) == 0.0  # all of it W
    assert input_share(BackwardSplit(0.5, 0.5, 0, True), (1.0, 1.0)) == 0.5  # too small: half
    assert input_share(BackwardSplit(0.5, 0.5, 0, False), (1.0, 1.0)) == 1.0  # no weights
