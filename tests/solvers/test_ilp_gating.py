"""The ILP runs only where it can gain ([Note: when the ILP can gain]); "exact" names the DP."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pandas as pd
import pytest

import autopipe.solvers.fixed_config as fixed_config
from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.dag_bound import dag_bound, forced_order
from autopipe.solvers.ilp import solve_ilp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain, transformer_dag
from tests.solvers.brute import best_dag_bottleneck
from tests.solvers.cbc_limits import record_cbc_limits


def _branches(blocks: int, thin: bool = True, seed: int = 0) -> Profile:
    """Blocks of a -> (b1 -> b2 | c1 -> c2) -> d; with ``thin`` the branch-internal values are
    big and the rest small, so a cut between the branches' halves is cheap only off the order."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    edges: list[tuple[str, str, int]] = []
    big, small = (10**6, 10**3) if thin else (10**3, 10**3)

    def add(name: str, fwd: float) -> str:
        rows.append({"layer": name, "fwd_ms": fwd, "bwd_ms": 0.0, "param_bytes": 100,
                     "output_bytes": 1, "saved_bytes": 10})
        return name

    x = add("in", 1.0)
    for b in range(blocks):
        a, b1, c1 = add(f"{b}a", 1.0), add(f"{b}b1", float(rng.uniform(1, 4))), add(f"{b}c1", 1.0)
        b2, c2, d = add(f"{b}b2", 1.0), add(f"{b}c2", float(rng.uniform(1, 4))), add(f"{b}d", 1.0)
        edges += [(x, a, small), (a, b1, small), (a, c1, small), (b1, b2, big), (c1, c2, big),
                  (b2, d, small), (c2, d, small)]
        x = d
    return Profile.from_frame(pd.DataFrame(rows), edges=edges)


def _no_ilp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ILP refused, and the step's search after it left out: what the DP and the gate prove."""
    monkeypatch.setattr(fixed_config, "shortest", lambda best, *args: best)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the ILP ran")
    monkeypatch.setattr(fixed_config, "solve_ilp", refuse)


@pytest.mark.parametrize("prof", [random_chain(40, 3), transformer_dag(4)], ids=["chain", "one-order dag"])
def test_one_topological_order_never_runs_the_ilp(prof: Profile, monkeypatch: pytest.MonkeyPatch) -> None:
    assert forced_order(LayerCosts.from_profile(prof))
    _no_ilp(monkeypatch)
    plan = partition(prof, stages=4, chunks=4, memory_limit="1GiB")
    assert plan.method == "exact" and plan.solver.status == "optimal" and plan.solver.gap == 0.0


def test_a_dag_the_bound_proves_skips_the_ilp(monkeypatch: pytest.MonkeyPatch) -> None:
    prof = _branches(30, thin=False)  # branches, but every cut value costs the same
    lc = LayerCosts.from_profile(prof)
    assert not forced_order(lc)
    _no_ilp(monkeypatch)
    plan = partition(prof, stages=4, chunks=4)
    assert plan.method == "exact" and plan.solver.status == "optimal"
    assert plan.solver.bound is not None and plan.solver.gap is not None and plan.solver.gap <= 0.005
    assert plan.solver.bound <= plan.bottleneck


def test_a_dag_where_the_ilp_gains_gets_its_split() -> None:
    prof = _branches(1)
    exact = partition(prof, stages=2, chunks=4, recompute="never", method="exact")
    assert exact.solver.status == "optimal over the topological order" and exact.solver.bound is None
    auto = partition(prof, stages=2, chunks=4, recompute="never", time_limit=20, progress=False)
    assert auto.method == "ilp" and auto.bottleneck < exact.bottleneck * (1 - 1e-3)
    assert auto.solver.status == "optimal" and auto.solver.gap is not None and auto.solver.gap <= 0.005


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("recompute", ["except_last", "never"])
def test_dag_bound_is_below_every_split(seed: int, recompute: str) -> None:
    lc = LayerCosts.from_profile(_branches(1, seed=seed))
    devices = [DeviceSpec("a"), DeviceSpec("b", speed=2.0), DeviceSpec("c")]
    opts = CostOptions(4, recompute, bandwidth=1e6)
    bound = dag_bound(lc, devices, opts)
    assert bound is not None and 0 < bound <= best_dag_bottleneck(lc, devices, opts) + 1e-9


def test_the_time_budget_is_kept_shown_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget reaches CBC as its wall-clock limit, is shown on the progress line, and the
    ILP's seconds and status are the plan's. Not timed: CBC keeps its own limit; the second
    solve runs CBC with a limit it always overruns (tests/solvers/cbc_limits.py), so that it
    stops on time on any host."""
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    solved: list[Any] = []

    def kept(*args: Any, **kwargs: Any) -> Any:
        solved.append(solve_ilp(*args, **kwargs))
        return solved[-1]

    monkeypatch.setattr(fixed_config, "solve_ilp", kept)
    limits = record_cbc_limits(monkeypatch)
    plan = partition(_branches(1), stages=2, chunks=4, recompute="never", method="ilp", progress=True)
    assert "/5 s" in err.getvalue()  # the default budget, on the progress line
    assert limits == [(5, "elapsed")]  # ... and CBC's: `cbc -sec 5 -timeMode elapsed`
    assert plan.solver.status == solved[0].status == "optimal"
    assert plan.solver.seconds >= solved[0].seconds > 0  # the DP's and the ILP's
    limits = record_cbc_limits(monkeypatch, overrun=True)
    slow = partition(_branches(12), stages=4, chunks=4, bandwidth=1e5, method="ilp", time_limit=1,
                     progress=False)
    assert limits == [(1, "elapsed")]
    assert slow.solver.status == solved[1].status == "time_limit"
    assert slow.solver.gap is not None and slow.solver.gap > 0 and slow.solver.gap == solved[1].gap
    assert slow.solver.seconds >= solved[1].seconds > 0


@pytest.mark.parametrize("limit", [0, -1.0, True, "5"])
def test_bad_time_limit_is_one_line(limit: Any) -> None:
    with pytest.raises(PartitionError, match=r"^time_limit=.*: need the ILP's seconds > 0") as err:
        partition(random_chain(6), stages=2, time_limit=limit)
    assert "\n" not in str(err.value)


def test_unknown_method_names_exact() -> None:
    with pytest.raises(PartitionError, match=r"method='nope' is unknown; choose one of \['auto', 'exact'"):
        partition(random_chain(6), stages=2, method="nope")


def test_dp_is_an_alias_of_exact_in_calls_and_saved_plans() -> None:
    prof = random_chain(12, 1)
    old = partition(prof, stages=3, chunks=4, method="dp")
    new = partition(prof, stages=3, chunks=4, method="exact")
    assert old.method == new.method == "exact" and old.stages == new.stages
    saved = {**new.to_dict(), "method": "dp"}  # a plan saved before the rename
    assert Plan.from_dict(saved).method == "exact"
