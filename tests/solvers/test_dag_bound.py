"""autopipe/solvers/dag_bound.py against brute force: the boundary values are exactly the ideals'
sums, and on a chain with free transfers the bound is the best split's bottleneck itself."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest

import autopipe.solvers.dag_bound as dag_bound_module
from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.solvers.dag_bound import _boundaries, dag_bound, forced_order
from tests.solvers.brute import best_dag_bottleneck


def _dag(n: int, edges: list[tuple[int, int]], seed: int, fwd: list[float] | None = None) -> LayerCosts:
    """``n`` layers in this order with whole-number times (exact sums) and these edges; nothing
    crosses a cut (free transfers)."""
    rng = np.random.default_rng(seed)
    times = fwd or [float(rng.integers(1, 9)) for _ in range(n)]
    rows: list[dict[str, Any]] = [
        {"layer": f"l{i}", "fwd_ms": times[i], "bwd_ms": float(rng.integers(1, 9)),
         "param_bytes": 0, "output_bytes": 0, "saved_bytes": 0} for i in range(n)]
    return LayerCosts.from_profile(Profile.from_frame(
        pd.DataFrame(rows), edges=[(f"l{u}", f"l{v}", 0) for u, v in edges]))


def _random_dag(n: int, seed: int) -> LayerCosts:
    rng = np.random.default_rng(seed)
    edges = [(u, v) for v in range(1, n) for u in range(v) if rng.random() < 0.35]
    return _dag(n, edges, seed)


def _ideal_sums(lc: LayerCosts) -> list[tuple[float, float]]:
    n = len(lc)
    out = set()
    for members in itertools.product((False, True), repeat=n):
        if all(members[u] or not members[v] for u in range(n) for v in lc.consumers[u]):
            out.add((sum(float(lc.fwd[i]) for i in range(n) if members[i]),
                     sum(float(lc.bwd[i]) for i in range(n) if members[i])))
    return sorted(out)


@pytest.mark.parametrize("seed", range(12))
def test_the_boundaries_are_the_sums_of_every_ideal(seed: int) -> None:
    lc = _random_dag(3 + seed % 6, seed)
    points = _boundaries(lc)
    assert points is not None and points.dtype == np.float64
    assert [tuple(p) for p in points.tolist()] == _ideal_sums(lc)


def test_a_layer_that_skips_the_last_leaves_the_order_open() -> None:
    assert forced_order(_dag(4, [(0, 1), (1, 2), (2, 3)], 0))
    assert not forced_order(_dag(4, [(0, 1), (1, 2), (1, 3)], 0))  # 2 does not feed 3
    assert not forced_order(_dag(4, [(0, 1), (0, 2), (2, 3)], 0))  # 1 does not feed 2
    assert forced_order(_dag(1, [], 0))


@pytest.mark.parametrize(("n", "edges"), [
    (4, [(0, 1), (1, 2), (2, 3)]),  # a chain: every prefix a separator
    (4, [(0, 1), (0, 2), (1, 3), (2, 3)]),  # a diamond
    (5, [(0, 2), (1, 2), (2, 3), (2, 4)]),  # two inputs, two outputs
    (6, [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 5)]),  # two branches of two
    (5, []),  # no edges: every subset is an ideal
    (2, [(0, 1)]), (1, []),
])
def test_the_boundaries_of_shapes(n: int, edges: list[tuple[int, int]]) -> None:
    lc = _dag(n, edges, n)
    points = _boundaries(lc)
    assert points is not None and [tuple(p) for p in points.tolist()] == _ideal_sums(lc)


def test_too_many_boundaries_give_no_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    lc = _dag(4, [(0, 1), (0, 2), (0, 3)], 1, fwd=[1.0, 10.0, 100.0, 1000.0])
    count = len(_ideal_sums(lc))
    assert count == 1 + 2**3  # the empty one; the root with any of its three users
    monkeypatch.setattr(dag_bound_module, "MAX_BOUNDARIES", count)
    assert _boundaries(lc) is not None
    assert dag_bound(lc, [DeviceSpec("a"), DeviceSpec("b")], CostOptions(2, "never")) is not None
    monkeypatch.setattr(dag_bound_module, "MAX_BOUNDARIES", count - 1)
    assert _boundaries(lc) is None
    assert dag_bound(lc, [DeviceSpec("a"), DeviceSpec("b")], CostOptions(2, "never")) is None


@pytest.mark.parametrize("recompute", ["never", "always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_on_a_chain_the_bound_is_the_best_split(recompute: str, schedule: str) -> None:
    lc = dataclasses.replace(
        _dag(5, [(i, i + 1) for i in range(4)], 7), call_fwd_ms=0.25, call_bwd_ms=0.5,
        schedule_calls=(("1f1b", 0.75, 1.25),), recompute_ratio=0.5, recompute_call_ms=0.125)
    devices = [DeviceSpec("a"), DeviceSpec("b", speed=2.0), DeviceSpec("c", speed=0.5)]
    opts = CostOptions(4, recompute, schedule=schedule)
    bound = dag_bound(lc, devices, opts)
    assert bound == pytest.approx(best_dag_bottleneck(lc, devices, opts), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_on_a_dag_the_bound_is_below_every_split(seed: int) -> None:
    lc = _random_dag(6, seed + 20)
    devices = [DeviceSpec("a", speed=2.0), DeviceSpec("b")]
    opts = CostOptions(2, "always")
    bound = dag_bound(lc, devices, opts)
    assert bound is not None and 0 < bound <= best_dag_bottleneck(lc, devices, opts) + 1e-9


def _relaxation(lc: LayerCosts, speeds: list[float]) -> float:
    """The bound as the module defines it, by brute force: boundary values v_0 = (0, 0) <= v_1
    <= ... <= v_K = (all forward, all backward), each an ideal's sums and each dominating the last
    in both; a stage on a device of speed x takes (forward + backward) / x (nothing recomputed,
    no call cost), and the bound is the least over such sequences of the slowest stage."""
    values = _ideal_sums(lc)
    end = values[-1]
    best = np.inf
    for middle in itertools.product(values, repeat=len(speeds) - 1):
        seq = [(0.0, 0.0), *middle, end]
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(seq)]
        if all(df >= 0 and db >= 0 for df, db in steps):
            best = min(best, max((df + db) / x for (df, db), x in zip(steps, speeds, strict=True)))
    return float(best)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("speeds", [[1.0, 1.0, 1.0], [2.0, 1.0, 0.5], [1.0, 4.0]])
def test_the_bound_is_its_relaxation(seed: int, speeds: list[float]) -> None:
    lc = _random_dag(4 + seed % 3, seed + 40)
    lc = dataclasses.replace(lc, fwd=lc.fwd / 64, bwd=lc.bwd / 64)  # exact, and below 1 ms
    bound = dag_bound(lc, [DeviceSpec(f"d{i}", speed=x) for i, x in enumerate(speeds)],
                      CostOptions(2, "never"))
    assert bound == pytest.approx(_relaxation(lc, speeds), rel=1e-12, abs=1e-15)


def test_more_boundaries_than_one_block() -> None:
    # nine layers with no edges: every subset an ideal, 512 distinct sums (dag_bound._BLOCK is
    # 256); any subset against the rest is a split, so the bound is the best of those
    lc = _dag(9, [], 0, fwd=[float(2**i) for i in range(9)])
    assert len(_ideal_sums(lc)) == 512
    devices = [DeviceSpec("a"), DeviceSpec("b", speed=2.0)]
    opts = CostOptions(2, "never")
    assert dag_bound(lc, devices, opts) == pytest.approx(best_dag_bottleneck(lc, devices, opts), rel=1e-12)


def test_the_cap_counts_the_ideals_enumerated(monkeypatch: pytest.MonkeyPatch) -> None:
    # a root and three users of equal times: 1 + 2^3 ideals but 1 + 1 + 3 distinct sums
    lc = _dag(4, [(0, 1), (0, 2), (0, 3)], 3, fwd=[1.0, 10.0, 10.0, 10.0])
    lc = dataclasses.replace(lc, bwd=np.array([1.0, 10.0, 10.0, 10.0]))
    assert len(_ideal_sums(lc)) == 5
    monkeypatch.setattr(dag_bound_module, "MAX_BOUNDARIES", 9)
    assert _boundaries(lc) is not None
    monkeypatch.setattr(dag_bound_module, "MAX_BOUNDARIES", 8)
    assert _boundaries(lc) is None


def test_each_boundary_holds_no_less_of_either_sum() -> None:
    # found by search: letting one sum fall from a boundary to the next (while the other grows)
    # would balance these three stages better, 7/8 instead of 1
    one, other = [0.0, 0.25, 0.0, 0.0, 0.0], [0.625, 0.5, 0.0, 0.375, 0.625]
    for fwd, bwd in ((one, other), (other, one)):  # the forward sum falling, then the backward
        lc = dataclasses.replace(_dag(5, [(0, 2), (1, 2), (0, 4), (3, 4)], 0, fwd=fwd), bwd=np.array(bwd))
        bound = dag_bound(lc, [DeviceSpec(f"d{i}") for i in range(3)], CostOptions(2, "never"))
        assert bound == _relaxation(lc, [1.0, 1.0, 1.0]) == 1.0
