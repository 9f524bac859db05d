"""Many splits' steps at once ([Note: steps in a batch]): checked against the simulator, one split
at a time, under every schedule and merge rule."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from autopipe.core.corrections import Transfer
from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate_stages
from autopipe.solvers.split_steps import SplitSteps
from autopipe.solvers.synthetic import random_chain, transformer_dag
from executor.spec import SCHEDULES, merge_rules

# each schedule's 4 stages on their devices: one each, or two ranks as the runtime places them
NAMES = {"gpipe": ["a", "b", "c", "d"], "1f1b": ["a", "b", "c", "d"],
         "interleaved1f1b": ["r0", "r1", "r0", "r1"], "interleaved_zb": ["r0", "r1", "r0", "r1"],
         "zbv": ["r0", "r1", "r1", "r0"], "dualpipev": ["r0", "r1", "r1", "r0"]}


def _simulated(costs: LayerCosts, cuts: tuple[int, ...], devices: list[DeviceSpec], opts: CostOptions) -> float:
    """The split's step as the step's search scores it: simulated under each merge rule, the best."""
    assignment = [sum(i >= c for c in cuts) for i in range(len(costs))]
    best = math.inf
    for rule in merge_rules(opts.schedule):
        o = dataclasses.replace(opts, merge=rule)
        sim = simulate_stages(stage_costs(costs, assignment, devices, o), chunks=o.chunks,
                              recompute=o.modes(len(devices)), ms_per_byte=o.ms_per_byte,
                              schedule=o.schedule, devices=[d.name for d in devices], merge=rule)
        best = min(best, sim.iteration_time)
    return best


def _measured_link(prof: Profile) -> Profile:
    """``prof`` with a transfer as `autopipe profile --comm` measures one: latency, receive share."""
    return dataclasses.replace(prof, corrections=dataclasses.replace(
        prof.corrections, transfer=Transfer(0.01, 2e9, 0.5)))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", ["chain", "dag with skips, measured link, except_last"])
def test_the_batch_is_each_splits_simulated_step(schedule: str, case: str) -> None:
    if case == "chain":
        prof, recompute, bandwidth = random_chain(9, 3, split=True), "never", 1e9
    else:
        prof, recompute, bandwidth = _measured_link(transformer_dag(1, 2, split=True)), "except_last", None
    costs = LayerCosts.from_profile(prof)
    devices = [DeviceSpec(name, speed=1.5 if name == "b" else 1.0) for name in NAMES[schedule]]
    opts = CostOptions(8, recompute, schedule=schedule, bandwidth=bandwidth)
    steps = SplitSteps.of(costs, devices, opts)
    assert steps is not None and steps.exact
    cuts = list(itertools.combinations(range(1, len(costs)), 3))[::5]
    lows = steps(np.array(cuts))
    for split, low in zip(cuts, lows, strict=True):
        assert low == pytest.approx(_simulated(costs, split, devices, opts), rel=1e-12), split


def test_with_replicas_the_batch_is_below_the_step() -> None:
    # the data-parallel collectives are left out: a lower bound, no longer the step itself
    costs = LayerCosts.from_profile(random_chain(10, 1, split=True))
    devices = [DeviceSpec(n) for n in NAMES["1f1b"]]
    opts = CostOptions(4, "never", schedule="1f1b", data_parallel=4)
    steps = SplitSteps.of(costs, devices, opts)
    assert steps is not None and not steps.exact
    cuts = list(itertools.combinations(range(1, 10), 3))
    simulated = np.array([_simulated(costs, c, devices, opts) for c in cuts])
    lows = steps(np.array(cuts))
    assert (lows <= simulated * (1 + 1e-12)).all() and (lows < simulated * (1 - 1e-6)).any()


def test_where_it_does_not_apply_there_is_no_batch() -> None:
    costs = LayerCosts.from_profile(random_chain(8, 0))
    shared = [DeviceSpec("cpu"), DeviceSpec("cpu")]  # the simulator picks among ready operations
    assert SplitSteps.of(costs, shared, CostOptions(4, "never")) is None
    alone = CostOptions(4, "never", recompute_layers=("l3",))  # a stage's backward changes shape
    assert SplitSteps.of(costs, [DeviceSpec("a"), DeviceSpec("b")], alone) is None
