"""When the DAG's ILP can beat the DP over the topological order, by a lower bound on every split.

[Note: when the ILP can gain] The DP (stage_dp.py) is exact over splits that are contiguous in
the profile's topological order; the ILP (ilp.py) searches every precedence-respecting split of
the DAG. Each stage boundary of a DAG split is an ideal (a set of layers holding every
predecessor of its members), and the DP sees only the ideals that are prefixes of the order.

- ``forced_order``: every layer feeds the next one (chains, and transformer blocks whose
  residual skips run alongside a path through every layer). The order is then the DAG's only
  topological order, every ideal is a prefix, and the DP is exact over the DAG.
- ``dag_bound``: otherwise, prefix p is a *separator* when every ideal either lies inside it or
  contains it (every later layer has all of it as ancestors). Every ideal is a separator prefix
  plus an ideal of the *region* up to the next separator, so enumerating the regions' ideals
  (a handful for q / k / v or gate / up branches) gives every value (forward ms, backward ms) a
  stage boundary can take. A min-max DP over those values, in which a stage costs its compute
  and fixed call cost only (no transfers, memory or ties: each only adds) and the next boundary
  dominates the last in both sums (as a superset does), is a lower bound on the bottleneck of
  every DAG split. A DP split within the ILP's gap of it is what the ILP would return, so the
  ILP runs only above it; where the regions have too many ideals there is no bound (None).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopipe.core.cost import DeviceSpec, LayerCosts, layer_work, stage_fixed_ms
from autopipe.core.cost_options import CostOptions
from autopipe.core.layer_costs import FloatArray

__all__ = ["MAX_BOUNDARIES", "forced_order", "dag_bound"]

MAX_BOUNDARIES = 4000  # distinct boundary values the bound's DP takes (it is quadratic in them)
_BLOCK = 256  # boundaries per vectorised step of that DP


def forced_order(costs: LayerCosts) -> bool:
    """True when every layer feeds the next: the topological order is the only one."""
    return all(i + 1 in users for i, users in enumerate(costs.consumers[:-1]))


def dag_bound(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> float | None:
    """No split of ``costs``' DAG into ``len(devices)`` stages has a smaller bottleneck (ms); None
    when the DAG's boundaries are too many to enumerate ([Note: when the ILP can gain])."""
    points = _boundaries(costs)
    if points is None:
        return None
    fwd, bwd = points[:, 0], points[:, 1]
    m, k = options.chunks, len(devices)
    recomputed = options.recomputed(k)
    call = costs.call_ms(options.schedule)
    best = np.full(len(points), np.inf)
    best[0] = 0.0  # no stage yet: the empty boundary
    for s, dev in enumerate(devices):
        fixed = stage_fixed_ms(call, costs.recompute_call_ms, recomputed[s], m)
        # a stage's compute is linear in its forward and backward sums
        per_fwd = float(layer_work(1.0, 0.0, recomputed[s], m, costs.recompute_ratio)) / dev.speed
        best = _stage(best, fwd, bwd, per_fwd, 1.0 / dev.speed, fixed)
    return float(best[-1])


def _stage(best: FloatArray, fwd: FloatArray, bwd: FloatArray, per_fwd: float, per_bwd: float,
           fixed: float) -> FloatArray:
    """One more stage: out[j] = min over boundaries i that j dominates of max(best[i], the
    stage's time from i to j)."""
    out = np.full_like(best, np.inf)
    for j0 in range(0, len(best), _BLOCK):
        j1 = min(j0 + _BLOCK, len(best))
        df = fwd[j0:j1, None] - fwd[None, :j1]
        db = bwd[j0:j1, None] - bwd[None, :j1]
        t = np.maximum(best[None, :j1], per_fwd * df + per_bwd * db + fixed)
        t[(df < -1e-9) | (db < -1e-9)] = np.inf  # a boundary before j holds no more than j
        out[j0:j1] = t.min(axis=1)
    return out


def _boundaries(costs: LayerCosts) -> FloatArray | None:
    """Every (forward, backward) sum an ideal of the DAG can have, sorted, the empty one first
    and the whole graph last; None beyond MAX_BOUNDARIES."""
    n = len(costs)
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, users in enumerate(costs.consumers):
        for v in users:
            preds[v].append(u)
    inside = _prefix_inside_ancestors(preds)
    cuts = [0]  # separators: every layer from p on has the whole prefix [0, p) as ancestors
    low = n
    for p in range(n - 1, 0, -1):
        low = min(low, inside[p])
        if low >= p:
            cuts.append(p)
    cuts = sorted(cuts) + [n]
    f_prefix = np.concatenate([[0.0], np.cumsum(costs.fwd)])
    b_prefix = np.concatenate([[0.0], np.cumsum(costs.bwd)])
    values: set[tuple[float, float]] = {(0.0, 0.0)}
    for p, q in zip(cuts, cuts[1:], strict=False):
        ideals = _region_ideals(costs, preds, p, q, MAX_BOUNDARIES - len(values))
        if ideals is None:
            return None
        values.update((f_prefix[p] + f, b_prefix[p] + b) for f, b in ideals)
        if len(values) > MAX_BOUNDARIES:
            return None
    return np.array(sorted(values), dtype=np.float64)


def _prefix_inside_ancestors(preds: list[list[int]]) -> list[int]:
    """For each layer v, the longest prefix [0, p) of the order whose layers are all ancestors of v."""
    ancestors: list[int] = []  # bit u set: u is an ancestor
    inside = []
    for ps in preds:
        mask = 0
        for u in ps:
            mask |= ancestors[u] | (1 << u)
        ancestors.append(mask)
        inside.append((~mask & (mask + 1)).bit_length() - 1)  # trailing ones
    return inside


def _region_ideals(costs: LayerCosts, preds: list[list[int]], p: int, q: int,
                   limit: int) -> list[tuple[float, float]] | None:
    """(forward, backward) sums of the ideals of layers [p, q) (predecessors before p are in
    every such ideal); None beyond ``limit`` of them."""
    states: dict[int, tuple[float, float]] = {0: (0.0, 0.0)}  # bit v - p: v is in the ideal
    for v in range(p, q):
        need = 0
        for u in preds[v]:
            if u >= p:
                need |= 1 << (u - p)
        bit = 1 << (v - p)
        grown = {mask | bit: (f + float(costs.fwd[v]), b + float(costs.bwd[v]))
                 for mask, (f, b) in states.items() if mask & need == need}
        states.update(grown)
        if len(states) > max(limit, 0) + 1:
            return None
    return list(states.values())
