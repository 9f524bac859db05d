"""[Note: measured overheads]: the profiler measures a stage call's fixed cost and the recompute
ratio in both profile modes, and they reach the plan's stage times."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

import autopipe
from autopipe.core.cost import LayerCosts
from autopipe.frontend.profiling.corrections.overheads import (
    CALL_REPEATS,
    CALL_STAGES,
    CALL_WARMUP,
    stage_call_ms,
)
from autopipe.frontend.profiling.harness.timing import CpuTimer, Timer
from tests.frontend.profiling.counted import CLOCK, Cost, CountedChain
from tests.models import Chain

T = TypeVar("T")


@pytest.mark.parametrize("mode", ["whole", "layers"])
def test_profile_records_the_overheads_in_both_modes(mode: str) -> None:
    model, x = Chain((64, 256, 256, 64)), torch.randn(32, 64)
    prof = autopipe.profile(model, (x,), chunks=2, repeats=2, warmup=1, mode=mode)
    call = prof.corrections.stage_calls["gpipe"]["gpipe"]  # executor.GPipe's: every profile times it
    assert list(prof.corrections.stage_calls) == ["gpipe"] and math.isfinite(call.bwd_ms) and call.bwd_ms >= 0
    assert call.fwd_ms > 0  # an empty pipeline still takes time
    costs = LayerCosts.from_profile(prof)
    assert costs.runtime == "gpipe" and costs.call_ms() == pytest.approx(call.fwd_ms + call.bwd_ms)
    plan = autopipe.partition(prof, stages=2, chunks=2, recompute="never", bandwidth=None)
    layers = sum(prof.df.loc[prof.df["layer"].isin(s), ["fwd_ms", "bwd_ms"]].to_numpy().sum()
                 for s in plan.stages[:1])
    assert plan.stage_times[0] == pytest.approx(layers + costs.call_ms(), abs=1e-6)


# declared ms (tests/frontend/profiling/counted.py): forward, without autograd, cold start, backward halves
A, B = Cost(2.0, 1.5, 1.0, 3.0, 1.0), Cost(6.0, 4.0, 1.0, 5.0, 2.0)


@pytest.mark.parametrize(("mode", "ratio"), [
    # run whole: executor.GPipe recomputes the graph, each checkpointed forward without autograd
    # and cold (a, b, a, b): its extra over the whole forward, cold too
    ("whole", (1.5 + 1.0 + 4.0 + 1.0) / (2.0 + 1.0 + 6.0 + 1.0)),
    # layer by layer: the sampled layers' extra over their forward alone (warm); only b is
    # sampled, as a's input (the model's) needs no gradient
    ("layers", 4.0 / 6.0),
])
def test_the_recompute_ratio_is_the_checkpointed_extra_over_the_forward(mode: str, ratio: float) -> None:
    prof = autopipe.profile(CountedChain(A, B), (torch.randn(8, 4),), chunks=2, repeats=3, warmup=1, mode=mode,
                            timer=CpuTimer(clock=CLOCK), progress=False)
    assert prof.corrections.recompute_ratio == pytest.approx(ratio, abs=1e-4)


class _TwoPipes(Timer):
    """Times nothing: reports ``ms[pipe][phase]``, the first pipe's for its warmup and repeats'
    forwards and backwards, then the second's."""

    def __init__(self, ms: tuple[tuple[float, float], tuple[float, float]]) -> None:
        self.ms, self.calls = ms, 0

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        pipe, phase = divmod(self.calls, 2 * (CALL_WARMUP + CALL_REPEATS))
        self.calls += 1
        return fn(), self.ms[pipe][phase % 2]


def test_stage_call_is_per_stage_and_micro_batch() -> None:
    # the plain empty pipeline takes 6 + 12 ms, checkpointed 9 + 18: over stages x micro-batches
    timer, calls = _TwoPipes(((6.0, 12.0), (9.0, 18.0))), CALL_STAGES * 3
    fwd, bwd, recompute = stage_call_ms(timer, torch.device("cpu"), chunks=3)
    assert timer.calls == 2 * 2 * (CALL_WARMUP + CALL_REPEATS)  # both pipelines, every step
    assert (fwd, bwd, recompute) == pytest.approx((6.0 / calls, 12.0 / calls, 9.0 / calls))
    # measured on this process's CPU time (other processes' time slices do not count): the
    # checkpointed call does more work, two more autograd nodes and the RNG state
    fwd, bwd, recompute = stage_call_ms(CpuTimer(clock=time.process_time), torch.device("cpu"), chunks=3)
    assert fwd > 0 and bwd >= 0 and recompute > 0


@pytest.mark.timeout(60, method="thread")  # unfixed, it ran for minutes in C++ backward
def test_sampling_a_layer_that_returns_a_parameter_leaves_it_a_leaf() -> None:
    # [Note: a layer that returns a parameter]: checkpointed, w.to(w.dtype) (w itself) got the
    # checkpoint's grad_fn, and every later repeat re-entered every earlier recomputation
    from torch import fx, nn

    from autopipe.frontend.profiling.corrections.overheads import RecomputeSampler
    from autopipe.frontend.profiling.harness.replay import LayerCall, Values

    root = nn.Module()
    root.w = nn.Parameter(torch.randn(3))
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.call_method("to", (graph.get_attr("w"), torch.float32))
    graph.output((graph.call_function(torch.mul, (x, 2.0)), w))
    call = LayerCall("layer", fx.GraphModule(root, graph), ["x"], ["mul", "to"])
    sampler = RecomputeSampler(CpuTimer(), repeats=3, warmup=1)
    sampler.offer(call, Values({"x": torch.randn(3, requires_grad=True)}), fwd_ms=1.0, bwd_ms=1.0)
    assert sampler.samples == 1 and len(sampler.top) == 1  # it was timed checkpointed
    assert root.w.is_leaf and root.w.grad_fn is None
