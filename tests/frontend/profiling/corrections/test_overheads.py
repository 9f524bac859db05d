"""[Note: measured overheads]: the profiler measures a stage call's fixed cost and the recompute
ratio in both profile modes, and they reach the plan's stage times."""

from __future__ import annotations

import math

import pytest
import torch

import autopipe
from autopipe.core.cost import LayerCosts
from autopipe.frontend.profiling.corrections.overheads import RATIO_RANGE, stage_call_ms
from autopipe.frontend.profiling.harness.timing import CpuTimer
from tests.models import Chain


@pytest.mark.parametrize("mode", ["whole", "layers"])
def test_profile_records_the_overheads_in_both_modes(mode: str) -> None:
    model, x = Chain((64, 256, 256, 64)), torch.randn(32, 64)
    prof = autopipe.profile(model, (x,), chunks=2, repeats=2, warmup=1, mode=mode)
    call = prof.corrections.stage_calls["gpipe"]["gpipe"]  # executor.GPipe's: every profile times it
    assert list(prof.corrections.stage_calls) == ["gpipe"] and math.isfinite(call.bwd_ms) and call.bwd_ms >= 0
    assert call.fwd_ms > 0  # an empty pipeline still takes time
    low, high = RATIO_RANGE
    assert low <= prof.corrections.recompute_ratio <= high
    costs = LayerCosts.from_profile(prof)
    assert costs.runtime == "gpipe" and costs.call_ms() == pytest.approx(call.fwd_ms + call.bwd_ms)
    plan = autopipe.partition(prof, stages=2, chunks=2, recompute="never", bandwidth=None)
    layers = sum(prof.df.loc[prof.df["layer"].isin(s), ["fwd_ms", "bwd_ms"]].to_numpy().sum()
                 for s in plan.stages[:1])
    assert plan.stage_times[0] == pytest.approx(layers + costs.call_ms(), abs=1e-6)


def test_stage_call_is_per_stage_and_micro_batch() -> None:
    fwd, bwd, recompute = stage_call_ms(CpuTimer(), torch.device("cpu"), chunks=3)
    assert fwd > 0 and bwd >= 0 and recompute > 0  # checkpointing adds autograd nodes, RNG state


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
