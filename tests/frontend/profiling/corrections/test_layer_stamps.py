"""[Note: layer shares in sequence]: each layer's share of the whole graph, stamped in sequence."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from autopipe.frontend.profiling.corrections.in_sequence import _flat
from autopipe.frontend.profiling.corrections.layer_stamps import LayerStamps, layer_shares
from autopipe.frontend.profiling.harness.replay import graph_args
from autopipe.frontend.tracing.graph import trace
from tests.conftest import skip_if_no_cuda
from tests.frontend.profiling.counted import CLOCK, Cost, CountedChain
from tests.models import MultiIO, Skip


def test_each_interval_belongs_to_the_stamp_that_opens_it() -> None:
    # layer 0: 0-2 ms, a gap owned by nobody (-1) 2-3, layer 1: 3-9, layer 0 again 9-10;
    # the shares are of the 9 ms the layers own
    stamps = [(0, 0.0), (-1, 2.0), (1, 3.0), (0, 9.0), (-1, 10.0)]
    assert layer_shares(stamps, 3) == pytest.approx([3 / 9, 6 / 9, 0.0])
    assert layer_shares([], 2) == [0.0, 0.0]
    assert layer_shares([(0, 1.0), (0, 1.0)], 1) == [0.0]  # nothing timed: the caller keeps its own


class HeavyThenLight(nn.Module):
    """A large matmul, then one ``width / 2`` times smaller: at a size that keeps a device busy
    (not one bound by launching kernels), the first layer owns nearly all the time."""

    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.heavy = nn.Linear(width, width)
        self.light = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.light(self.heavy(x))


def _stamps(model: nn.Module, *inputs: Tensor, device: str = "cpu") -> tuple[LayerStamps, tuple[object, ...]]:
    g = trace(model, inputs)
    return LayerStamps(_flat(g.gm), g.node_layer, g.layers, torch.device(device)), graph_args(g, inputs)


def test_each_layer_owns_the_time_it_declares_in_both_passes() -> None:
    # on the counted clock a layer takes exactly what it declares: 9 + 1 ms forward (the light
    # one's 1 ms cold start paid in sequence), backward 6 ms (the weight's: the model's input
    # needs no gradient) and 1 + 1 ms
    heavy, light = Cost(9.0, 9.0, 0.0, 6.0, 6.0), Cost(0.0, 0.0, 1.0, 1.0, 1.0)
    g = trace(CountedChain(heavy, light), (torch.randn(8, 4),))
    stamps = LayerStamps(_flat(g.gm), g.node_layer, g.layers, torch.device("cpu"), clock=CLOCK)
    for _ in range(3):
        stamps.run(torch.randn(8, 4))
    fwd, bwd = stamps.shares()
    assert stamps.layers == ["a", "b"]
    assert fwd == pytest.approx([0.9, 0.1]) and bwd == pytest.approx([0.75, 0.25])


def test_warmup_runs_are_not_kept_and_no_run_gives_no_shares() -> None:
    stamps, args = _stamps(HeavyThenLight(), torch.randn(8, 512))
    assert stamps.shares() == ([], [])
    stamps.run(*args, keep=False)
    assert stamps.shares() == ([], [])


def test_the_stamped_graph_computes_what_the_plain_one_does() -> None:
    model, x = Skip(), torch.randn(4, 8)
    g = trace(model, (x,))
    stamps = LayerStamps(_flat(g.gm), g.node_layer, g.layers, torch.device("cpu"))
    torch.testing.assert_close(stamps.module(x), model(x))
    stamps.run(x)  # a skip connection: every layer is stamped, the shares still add up
    fwd, bwd = stamps.shares()
    assert len(fwd) == len(g.layers) and min(fwd) >= 0 and sum(bwd) == pytest.approx(1.0)


def test_outputs_without_gradient_leave_the_backward_unstamped() -> None:
    model = MultiIO().requires_grad_(False)
    stamps, args = _stamps(model, torch.randn(4, 8), torch.randn(4, 8))
    stamps.run(*args)
    fwd, bwd = stamps.shares()
    assert sum(fwd) == pytest.approx(1.0) and bwd == [0.0] * len(fwd)


class CastsItsWeight(nn.Module):
    """A layer that returns a parameter (as the Mamba scan's ``decay.to(float32)`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) * self.decay.to(torch.float32)


def test_a_returned_parameter_keeps_no_hook_after_the_run() -> None:
    # each run's gradient hooks end with it: on the user's model a later backward fires none of
    # them and appends nothing to the finished stamps
    model = CastsItsWeight()
    stamps, args = _stamps(model, torch.randn(2, 4))
    for _ in range(2):
        stamps.run(*args)
    assert not model.decay._backward_hooks
    kept = len(stamps._bwd)
    model(torch.randn(2, 4)).sum().backward()
    assert len(stamps._bwd) == kept


@skip_if_no_cuda
def test_cuda_stamps_are_events_read_after_one_synchronisation() -> None:
    # 275 GFLOP in the heavy layer's forward and as many in its backward (its weight's gradient:
    # the input needs none), 2048 times the light one's: milliseconds on any GPU, against the
    # microseconds of launching either layer's kernels
    model = HeavyThenLight(4096).cuda()
    stamps, args = _stamps(model, torch.randn(8192, 4096, device="cuda"), device="cuda")
    stamps.run(*args, keep=False)
    for _ in range(3):
        stamps.run(*args)
    fwd, bwd = stamps.shares()
    assert fwd[0] > 0.9 and bwd[0] > 0.9 and sum(fwd) == pytest.approx(1.0)
