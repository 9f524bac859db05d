from __future__ import annotations

import itertools
import time

import numpy as np
import pandas as pd
import pytest

from autopipe.core.cost import CostOptions, DeviceSpec, LayerCosts, stage_costs
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import solve_ilp
from autopipe.solvers.synthetic import random_chain, transformer_dag


def _two_branches(tie: bool = False) -> Profile:
    """a -> b1 -> b2 -> d and a -> c1 -> c2 -> d, rows interleaved (a, b1, c1, b2, c2, d); the
    branch-internal edges carry 1 MB, the rest 1 KB."""
    df = pd.DataFrame({
        "layer": ["a", "b1", "c1", "b2", "c2", "d"],
        "fwd_ms": [1.0, 4.0, 1.0, 1.0, 4.0, 1.0],
        "bwd_ms": [0.0] * 6,
        "param_bytes": [100, 500, 100, 100, 500, 100],
        "output_bytes": [1] * 6,
        "saved_bytes": [10] * 6,
        "tie_group": ["", "w", "", "", "w", ""] if tie else [""] * 6,
    })
    big, small = 10**6, 10**3
    edges = [("a", "b1", small), ("a", "c1", small), ("b1", "b2", big), ("c1", "c2", big),
             ("b2", "d", small), ("c2", "d", small)]
    return Profile.from_frame(df, edges=edges)


def brute_force(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> float:
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


def test_ilp_beats_dp_by_cutting_thin_values() -> None:
    lc = LayerCosts.from_profile(_two_branches())
    devices = [DeviceSpec("a"), DeviceSpec("b")]
    opts = CostOptions(chunks=2, checkpoint="never", bandwidth=1e9)  # 1 MB = 1 ms
    dp = solve_dp(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=20)
    assert ilp.status == "optimal" and ilp.gap <= 0.005
    assert ilp.assignment == [0, 0, 1, 0, 1, 1]  # {a, b1, b2} | {c1, c2, d}
    assert ilp.objective < dp.bottleneck - 1.0  # the DP must cut a 1 MB branch edge
    assert ilp.objective == pytest.approx(brute_force(lc, devices, opts), rel=1e-6)


@pytest.mark.parametrize("ties", ["share", "colocate"])
def test_ilp_matches_brute_force_with_ties_and_memory(ties: str) -> None:
    lc = LayerCosts.from_profile(_two_branches(tie=True))
    opts = CostOptions(chunks=2, checkpoint="never", optimizer="none", bandwidth=1e9, ties=ties)
    devices = [DeviceSpec("a", 900), DeviceSpec("b", 900), DeviceSpec("c", 900)]
    expected = brute_force(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, time_limit=20)
    assert ilp.objective == pytest.approx(expected, rel=1e-6)
    costs = stage_costs(lc, ilp.assignment, devices, opts)
    assert all(c.memory_bytes <= 900 for c in costs)
    if ties == "colocate":
        assert ilp.assignment[1] == ilp.assignment[4]


def test_ilp_equals_dp_on_chains() -> None:
    for seed in range(3):
        lc = LayerCosts.from_profile(random_chain(12, seed))
        total = stage_costs(lc, [0] * 12, [DeviceSpec("x")], CostOptions())[0].memory_bytes
        devices = [DeviceSpec("a", total // 2, 1.0), DeviceSpec("b", total // 2, 2.0), DeviceSpec("c", total // 2)]
        opts = CostOptions(bandwidth=1e9)
        dp = solve_dp(lc, devices, opts)
        ilp = solve_ilp(lc, devices, opts, time_limit=20)
        assert ilp.objective == pytest.approx(dp.bottleneck, rel=1e-6)


def test_ilp_infeasible_memory() -> None:
    lc = LayerCosts.from_profile(_two_branches())
    with pytest.raises(PartitionError, match="no split into 2 stages within the memory limits"):
        solve_ilp(lc, [DeviceSpec("a", 100), DeviceSpec("b", 100)], CostOptions(), time_limit=5)


def test_ilp_200_layer_dag_six_stages_is_proven_optimal_quickly() -> None:
    lc = LayerCosts.from_profile(transformer_dag(25))  # 202 layers, 50 skips, tied head
    devices = [DeviceSpec(f"d{s}") for s in range(6)]
    opts = CostOptions(bandwidth=10e9)
    start = time.perf_counter()
    dp = solve_dp(lc, devices, opts)
    ilp = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=60)
    elapsed = time.perf_counter() - start
    assert ilp.gap <= 0.005 and ilp.status == "optimal"
    assert ilp.objective <= dp.bottleneck + 1e-9
    assert elapsed < 40  # target 10 s; benchmarks/partition_speed.py reports the real number
