"""The truth the DAG solvers are checked against: every split, enumerated."""

from __future__ import annotations

import itertools

import numpy as np

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions


def best_dag_bottleneck(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> float:
    """The least bottleneck (ms) over every split of ``lc``'s DAG into ``len(devices)`` non-empty
    stages that respects its edges, tied layers together under ``ties="colocate"`` and each
    device's memory: each layer's stage enumerated, k^n splits."""
    n, k = len(lc), len(devices)
    best = np.inf
    for a in itertools.product(range(k), repeat=n):
        if len(set(a)) < k or any(a[u] > a[v] for u in range(n) for v in lc.consumers[u]):
            continue
        if opts.ties == "colocate" and any(len({a[v] for v in m}) > 1 for m, _ in lc.tie_groups):
            continue
        costs = stage_costs(lc, list(a), devices, opts)
        if all(d.memory is None or c.memory_bytes <= d.memory for c, d in zip(costs, devices, strict=True)):
            best = min(best, max(c.time_ms for c in costs))
    return float(best)
