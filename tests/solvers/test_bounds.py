"""The pipeline's bound on every split's simulated step, against every split simulated."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from autopipe.core.corrections import Transfer
from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.simulator import simulate_stages
from autopipe.solvers.bounds import config_bound, pipeline_bound
from autopipe.solvers.synthetic import random_chain, transformer_dag


def _fastest(costs: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> float:
    n, k = len(costs), len(devices)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        assignment = [sum(i >= c for c in cuts) for i in range(n)]
        sim = simulate_stages(stage_costs(costs, assignment, devices, opts), chunks=opts.chunks,
                              recompute=opts.modes(k), ms_per_byte=opts.ms_per_byte, schedule=opts.schedule,
                              devices=[d.name for d in devices])
        best = min(best, sim.iteration_time)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_no_split_beats_the_pipeline_bound(seed: int) -> None:
    # random configurations: chains and DAGs, a measured link, uneven speeds, stages sharing a
    # device, replicas, a mode per stage, fewer micro-batches than stages
    rng = random.Random(seed)
    prof = random_chain(rng.randint(6, 8), seed) if seed % 3 else transformer_dag(1, seed)
    if seed % 2:
        prof = dataclasses.replace(prof, corrections=dataclasses.replace(prof.corrections,
                                                                         transfer=Transfer(0.05, 1e9, 0.7)))
    costs = LayerCosts.from_profile(prof)
    k, m = rng.randint(2, 4), rng.choice([1, 3, 4, 8])
    names = [f"d{i}" for i in range(k)] if seed % 5 else ["shared"] * k
    devices = [DeviceSpec(name, speed=rng.choice([1.0, 2.0])) for name in names]
    modes = tuple(rng.choice(["never", "except_last", "always"]) for _ in range(k))
    opts = CostOptions(m, modes, schedule=("gpipe", "1f1b")[seed % 2], data_parallel=rng.choice([1, 2]))
    bound = pipeline_bound(costs, devices, opts)
    assert bound is not None and 0 < bound <= _fastest(costs, devices, opts) * (1 + 1e-12)


def test_the_pipeline_bound_is_near_the_fastest_split_where_the_totals_are_not() -> None:
    costs = LayerCosts.from_profile(random_chain(10, 0))
    devices = [DeviceSpec(name) for name in "abcd"]
    opts = CostOptions(8, "except_last", schedule="1f1b")
    fastest, bound = _fastest(costs, devices, opts), pipeline_bound(costs, devices, opts)
    assert bound is not None and bound > 0.9 * fastest
    assert config_bound("1f1b", costs, [1.0] * 4, 8) < 0.7 * fastest
    assert pipeline_bound(costs, devices, dataclasses.replace(opts, schedule="interleaved1f1b")) is None
