"""Recomputing chosen layers inside a stage: what each frees and what it costs.

[Note: recomputed layers] A stage's checkpoint mode recomputes a whole stage for some
micro-batches ([Note: per-stage recomputation] in executor/spec.py). Finer: a stage that
never recomputes as a whole can still drop, after every forward, what a few of its layers
save for backward and recompute those layers in the backward (each layer wrapped in
``torch.utils.checkpoint(..., use_reentrant=False)`` by autopipe/frontend/stages.py): the
layers whose saves are large for their forward time (an attention's probabilities, an
activation's input). ``Plan.recompute_layers`` names them; only a stage in mode ``never`` may
have any (a stage checkpointed as a whole recomputes them anyway).

For layer u, in the terms of [Note: saved once] (autopipe/core/layer_costs.py):

- held before: ``saved[u]``, its saves net of what its producers save too;
- held after: the copy of its inputs its checkpoint keeps, ``inputs[u]`` (a copy: a later
  in-place op on an input, an in-place ReLU after a residual add, must not change what the
  backward recomputes from), and its output where a consumer saves it as well (``resaved[u]``:
  u no longer does, the consumer still does);
- so it frees ``freed_bytes = max(saved[u] - inputs[u] - resaved[u], 0)`` per micro-batch held
  (a layer that frees nothing is never chosen: a Linear, which saves its input);
- and its backward runs its forward again first: ``recompute_alone_ms = fwd[u] x
  recompute_ratio + recompute_call_ms`` per micro-batch, the profile's measured recompute ratio and the fixed
  cost of a checkpoint call ([Note: measured overheads] in cost.py). Measured here on a
  Linear + GELU: extra = 1.2-1.5 x its no-grad forward + 0.13 ms.

``stage_costs`` (cost.py) subtracts the freed bytes from the stage's ``saved_bytes`` and adds the
extra time to its backward, for every micro-batch. :func:`choose` picks the layers of one stage
greedily, the most bytes freed per ms first, until the stage's activations fit; the planner
applies it after the split (autopipe/solvers/layer_recompute.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopipe.core.layer_costs import FloatArray, IntArray, LayerCosts
from autopipe.core.transfer import Amount

__all__ = ["choose", "extra_ms", "freed_bytes", "recompute_alone_ms"]


def freed_bytes(costs: LayerCosts) -> IntArray:
    """Bytes per held micro-batch each layer frees when recomputed ([Note: recomputed layers])."""
    return np.maximum(costs.saved - costs.inputs - costs.resaved, 0)


def recompute_alone_ms(fwd: Amount, count: Amount, ratio: float, call_ms: float, speed: float = 1.0) -> Amount:
    """What ``count`` layers of forward ``fwd`` (their sum), each recomputed alone, add to a
    backward per micro-batch on a device of relative ``speed``: the forward again x the
    measured ratio, and each checkpoint's call (host time, not scaled)."""
    return fwd * ratio / speed + count * call_ms


def extra_ms(costs: LayerCosts) -> FloatArray:
    """Backward time per micro-batch each layer adds when recomputed ([Note: recomputed layers])."""
    return np.asarray(recompute_alone_ms(costs.fwd, 1, costs.recompute_ratio, costs.recompute_call_ms))


def choose(costs: LayerCosts, layers: Sequence[int], need_bytes: float) -> list[int]:
    """Of ``layers`` (indices, one stage's), the ones to recompute so that at least
    ``need_bytes`` are freed per held micro-batch, the most bytes per ms first; [] when
    ``need_bytes <= 0``, and every layer that frees anything when all of them are not enough."""
    if need_bytes <= 0:
        return []
    freed, cost = freed_bytes(costs), extra_ms(costs)
    useful = [i for i in layers if freed[i] > 0]
    useful.sort(key=lambda i: (-freed[i] / max(float(cost[i]), 1e-9), i))
    chosen: list[int] = []
    total = 0
    for i in useful:
        if total >= need_bytes:
            break
        chosen.append(i)
        total += int(freed[i])
    return sorted(chosen)
