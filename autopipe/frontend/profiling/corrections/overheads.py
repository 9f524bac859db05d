"""What the per-layer profile leaves out: the fixed cost of a stage call, the real recompute cost.

[Note: measured overheads] (the cost model's side is in autopipe/core/cost.py) Summing layers
timed alone misses two costs a pipeline pays:

- A stage call. Every micro-batch runs through every stage module once forward and once
  backward, and the runtime does per-task work around it: the GraphModule's call, the
  micro-batch's Batch, fork / join and the worker dispatch, the autograd engine crossing into
  the stage, the split of the mini-batch and the join of the outputs. The layer harness
  subtracts its own empty call from every layer ([Note: harness overhead] in layer_timing.py),
  so none of this is in the layers' times. ``stage_call_ms`` times executor.GPipe itself, the
  runtime's own machinery, over ``CALL_STAGES`` EMPTY stages (inputs -> outputs, no op) on
  the profiled device with the profile's ``chunks``, one iteration forward + backward, and
  divides by stages x micro-batches. What is per iteration (split, join) is thereby spread
  over ``CALL_STAGES`` stages; a plan with another stage count gets it slightly wrong. The same
  empty stages checkpointed give ``recompute_call_ms``: what a checkpointed call adds whatever
  its layers (two more autograd nodes and a nested backward, the RNG state saved and
  restored), paid per stage and recomputed micro-batch; the whole graph's
  recompute ratio ([Note: layers in sequence]) is taken net of it.
- Recomputation. A checkpointed micro-batch runs its forward WITHOUT autograd (cheaper than the
  profiled forward), then recomputes it WITH autograd in backward, saving and restoring the RNG
  state around it; "one extra forward" is only roughly that. :class:`RecomputeSampler` times a
  few of the heaviest layers plain and checkpointed (torch.utils.checkpoint, reentrant: the
  same no-grad forward and recompute-in-backward as executor.recompute), both through the same
  harness, and ``recompute_ratio`` is their extra time over their profiled forward. Layers with
  no input that needs a gradient are skipped (a reentrant checkpoint could not reach them), and
  so are layers that write an input in place (checkpointed, that input is a leaf).

Both go into the profile's corrections (``stage_calls["gpipe"]``, ``recompute_call_ms``,
``recompute_ratio``: autopipe/core/corrections.py); a profile without them is read as today's
model (no call cost, ratio 1).
When the model runs whole, the ratio is measured on the whole graph through executor.GPipe
instead, and the layers' times are scaled to the graph's: [Note: layers in sequence] in
autopipe/frontend/profiling/corrections/in_sequence.py. The sampler's ratio remains for layer-by-layer profiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn

from autopipe.frontend.profiling.harness.layer_timing import fresh, leaves_as_views, time_runs
from autopipe.frontend.profiling.harness.replay import LayerCall, Values
from autopipe.frontend.profiling.harness.timing import Timer
from autopipe.frontend.profiling.harness.under_autocast import as_stage
from executor._torch_compat import tree_leaves
from executor.local.gpipe import GPipe

__all__ = ["CALL_STAGES", "RecomputeSampler", "stage_call_ms"]

CALL_STAGES = 2
CALL_REPEATS = 30
CALL_WARMUP = 3
SAMPLED_LAYERS = 4  # the heaviest layers the recompute ratio is taken from
MAX_SAMPLES = 12  # layers timed checkpointed at most (a rising sequence re-enters the top few)
RATIO_RANGE = (0.25, 4.0)  # outside it, a measurement is noise: clamp


def _empty_stage() -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.placeholder("x"))
    return fx.GraphModule(nn.Module(), graph)


def _empty_calls_ms(timer: Timer, device: torch.device, chunks: int, recompute: str,
                    precision: str) -> tuple[float, float]:
    stages = [as_stage(_empty_stage(), precision, device) for _ in range(CALL_STAGES)]
    pipe = GPipe(stages, [device] * CALL_STAGES, chunks=chunks, recompute=recompute)
    x = torch.zeros(chunks, 1, device=device)

    def make_forward() -> Callable[[], Any]:
        return functools.partial(pipe, x.clone().requires_grad_())

    fwd, bwd = time_runs(timer, make_forward, CALL_REPEATS, CALL_WARMUP)
    calls = CALL_STAGES * chunks
    return fwd / calls, bwd / calls


def stage_call_ms(timer: Timer, device: torch.device, chunks: int,
                  precision: str = "fp32") -> tuple[float, float, float]:
    """Forward and backward ms of one EMPTY stage call per micro-batch through executor.GPipe,
    and what checkpointing it adds ([Note: measured overheads]); each stage call enters the
    precision's autocast ([Note: profiling under a precision])."""
    fwd, bwd = _empty_calls_ms(timer, device, chunks, "never", precision)
    c_fwd, c_bwd = _empty_calls_ms(timer, device, chunks, "always", precision)
    return fwd, bwd, max(0.0, (c_fwd + c_bwd) - (fwd + bwd))


class RecomputeSampler:
    """Offered every measured layer with its profiled times, it keeps the ``SAMPLED_LAYERS``
    heaviest and times each checkpointed as it enters: ``ratio()`` is recompute / forward."""

    def __init__(self, timer: Timer, repeats: int, warmup: int) -> None:
        self.timer, self.repeats, self.warmup = timer, repeats, warmup
        self.top: list[tuple[float, float]] = []  # (profiled forward ms, extra ms checkpointed)
        self.samples = 0

    def _qualifies(self, fwd_ms: float) -> bool:
        if self.samples >= MAX_SAMPLES or fwd_ms <= 0:
            return False
        return len(self.top) < SAMPLED_LAYERS or fwd_ms > min(f for f, _ in self.top)

    def offer(self, call: LayerCall, values: Values, fwd_ms: float, bwd_ms: float) -> None:
        if bwd_ms <= 0 or not self._qualifies(fwd_ms):
            return
        args = call.arguments(values)
        leaves = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
        if not any(t.requires_grad for t in leaves):
            return
        self.samples += 1
        layer = leaves_as_views(call)  # [Note: a layer that returns a parameter]

        def plain() -> Callable[[], Any]:
            return functools.partial(layer, *fresh(args))

        def checkpointed() -> Callable[[], Any]:
            return functools.partial(torch.utils.checkpoint.checkpoint, layer,
                                     *fresh(args), use_reentrant=True)

        try:  # a layer that writes its input in place cannot run checkpointed: skip it
            c_fwd, c_bwd = time_runs(self.timer, checkpointed, self.repeats, self.warmup)
        except RuntimeError:
            return
        p_fwd, p_bwd = time_runs(self.timer, plain, self.repeats, self.warmup)
        self.top.append((fwd_ms, max(0.0, (c_fwd + c_bwd) - (p_fwd + p_bwd))))
        self.top = sorted(self.top, reverse=True)[:SAMPLED_LAYERS]

    def ratio(self) -> float:
        """Recompute cost / profiled forward over the sampled layers; 1.0 when none was."""
        fwd = sum(f for f, _ in self.top)
        if not self.top or fwd <= 0:
            return 1.0
        low, high = RATIO_RANGE
        return min(high, max(low, sum(e for _, e in self.top) / fwd))

