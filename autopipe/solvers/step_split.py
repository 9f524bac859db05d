"""The split with the shortest simulated step, for one configuration: exact by enumeration where
the splits are few, else a descent over the cuts, with the gap to a proven bound.

    best = fastest_step(costs, devices, bounded, options, seeds=[dp.assignment])
    best.assignment, best.iteration, best.exhaustive, best.bound, best.gap

[Note: the step, not the bottleneck] A user pays for the step: the simulated iteration of the
plan's own schedule. The min-max DP (autopipe.solvers.dp) minimises the slowest stage, which
under GPipe nearly always gives the fastest step, but under 1F1B, interleaved 1F1B and the
zero-bubble schedules a split whose slowest stage is a little slower can fill the pipeline's
warm-up and cool-down better: the step depends on every stage's time, where it sits, and which
rank holds it. So for one configuration (stages, devices, micro-batches, recomputation,
schedule) the planner scores contiguous splits of the topological order by the simulator
itself (``stage_costs`` then ``simulate_stages``, under each merge rule the schedule has), under
the DP's memory rule (each stage within its device's budget, [Note: interleaved memory]) and
each device's simulated peak within its memory, as the plan reports it (tied layers together
when ``ties="colocate"``):

- when the splits number at most ``ENUMERATE_SPLITS``, every one of them: the step is then
  optimal over the topological order (and optimal outright for a chain, whose order is the only
  one);
- else a descent from each seed (the caller's, the DP's, and the baselines': equal layer counts,
  parameters, torchgpipe's blockpartition), moving one cut or two neighbouring ones by one or two
  layers while the step gets shorter, for at most ``DESCENT_EVALUATIONS`` splits in all; its gap
  is stated against ``config_bound`` (autopipe/solvers/bounds.py), which no split beats.

It never returns a split slower than its seeds, so never slower than the DP's or a baseline's.
Each evaluation costs a millisecond or two of Python, which is why the enumeration is bounded.
``method="step"`` asks for it; ``method="auto"`` (the default) takes it under the schedules that
interleave forwards and backwards when it is faster than the DP's split, with a descent budget
that shrinks with layers x stages (:func:`shortest` for one configuration; the automatic search
for each such schedule's best configuration, search.py). Under GPipe the DP's split was within
1% of the fastest in every case measured, so auto keeps it there.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autopipe.core.cost import DeviceSpec, LayerCosts, layer_work, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan, SolverInfo
from autopipe.core.simulator import simulate_stages
from autopipe.errors import PartitionError
from autopipe.solvers.baselines import (
    blockpartition_sizes,
    param_counts,
    params_sizes,
    sizes_to_assignment,
    uniform_sizes,
)
from autopipe.solvers.bounds import config_bound
from autopipe.solvers.dag_bound import forced_order
from executor.spec import merge_rules

__all__ = ["StepSplit", "fastest_step", "step_split", "shortest", "auto_evaluations", "ENUMERATE_SPLITS",
           "DESCENT_EVALUATIONS"]

ENUMERATE_SPLITS = 500  # every split scored when there are at most this many
DESCENT_EVALUATIONS = 120  # splits a descent scores at most
# method="auto": the descent scores at most this many layer x stage terms in all (a split of N
# layers into K stages costs about N x K of them, ~2.5 us each here), and at least
# AUTO_MIN_EVALUATIONS splits: under a second for the 802-layer, 16-stage TinyLlama shape, the
# whole DESCENT_EVALUATIONS for a model of a few hundred layers
AUTO_STEP_WORK = 150_000
AUTO_MIN_EVALUATIONS = 16


def auto_evaluations(layers: int, stages: int) -> int:
    """The descent's budget of splits under method="auto" (see AUTO_STEP_WORK)."""
    return min(DESCENT_EVALUATIONS, max(AUTO_MIN_EVALUATIONS, AUTO_STEP_WORK // (layers * stages)))


@dataclass(frozen=True)
class StepSplit:
    """The fastest split found: each layer's stage, its simulated iteration (ms), whether every
    split was scored, the bound no split beats (ms) and the relative gap to it."""

    assignment: list[int]
    iteration: float
    exhaustive: bool
    bound: float
    evaluated: int

    @property
    def gap(self) -> float:
        return 0.0 if self.exhaustive or self.iteration <= 0 else max(0.0, 1 - self.bound / self.iteration)


def fastest_step(costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
                 options: CostOptions, seeds: Sequence[Sequence[int]],
                 evaluations: int = DESCENT_EVALUATIONS) -> StepSplit | None:
    """The contiguous split of ``costs``' layers over ``devices`` with the shortest simulated
    step under ``options`` ([Note: the step, not the bottleneck]); ``bounded``: the devices whose
    memory each stage must fit (the DP's); ``evaluations``: the descent's budget of splits scored.
    None when no seed is a contiguous split that fits."""
    n, k = len(costs), len(devices)
    step = _Scorer(costs, devices, bounded, options)
    seeds = [*seeds, *_baselines(costs, options, k)]
    starts = [c for c in (_cuts(s, k) for s in seeds) if c is not None and step(c) < math.inf]
    if not starts:
        return None
    if math.comb(n - 1, k - 1) <= ENUMERATE_SPLITS:
        best = min(itertools.combinations(range(1, n), k - 1), key=lambda c: (step(c), c))
        iteration = step(best)
        return StepSplit(_assignment(best, n), iteration, True, iteration, len(step.seen))
    ends = [_descend(step, start, n, evaluations) for start in sorted(set(starts), key=step)]
    best = min(ends, key=lambda c: (step(c), c))
    bound = config_bound(options.schedule, costs, [d.speed for d in devices], options.chunks)
    return StepSplit(_assignment(best, n), step(best), False, min(bound, step(best)), len(step.seen))


def step_split(costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
               options: CostOptions, seed: list[int], info: SolverInfo,
               evaluations: int = DESCENT_EVALUATIONS) -> tuple[list[int], str, SolverInfo]:
    """method="step": the split with the shortest simulated step, seeded by ``seed`` (the DP's)
    and the baselines' splits, with what is proven of it; ``seed`` and ``info`` when no seed fits."""
    start = time.perf_counter()
    found = fastest_step(costs, devices, bounded, options, [seed], evaluations)
    if found is None:
        return seed, "step", info
    seconds = info.seconds + time.perf_counter() - start
    if found.exhaustive:
        status = "optimal" if forced_order(costs) else "optimal over the topological order"
        return found.assignment, "step", SolverInfo(status, found.iteration, found.iteration, 0.0, seconds)
    return found.assignment, "step", SolverInfo(f"descent over {found.evaluated} splits", found.iteration,
                                                found.bound, found.gap, seconds)


def shortest(best: Plan, plan: Callable[[list[int], str, SolverInfo], Plan], costs: LayerCosts,
             devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec], options: CostOptions,
             seed: list[int], info: SolverInfo) -> Plan:
    """method="auto": ``best`` (the slowest stage's optimum), or, under a schedule that
    interleaves forwards and backwards, the split with a shorter simulated step where one exists
    (``plan`` builds a Plan of an assignment; see [Note: the step, not the bottleneck])."""
    if options.schedule == "gpipe":
        return best
    step = plan(*step_split(costs, devices, bounded, options, seed, info,
                            auto_evaluations(len(costs), len(devices))))
    return step if step.iteration_time < best.iteration_time * (1 - 1e-9) else best


def _descend(step: _Scorer, cuts: tuple[int, ...], n: int, evaluations: int) -> tuple[int, ...]:
    """From ``cuts``, the first shorter step one move away, while there is one and the budget
    (``evaluations`` splits scored in all, every seed's descent together) lasts."""
    improved = True
    while improved:
        improved = False
        for move in _moves(cuts, n):
            if len(step.seen) >= evaluations and move not in step.seen:
                return cuts
            if step(move) < step(cuts) * (1 - 1e-12):
                cuts, improved = move, True
                break
    return cuts


class _Scorer:
    """A split's simulated iteration (ms; inf when a stage does not fit), each scored once."""

    def __init__(self, costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
                 options: CostOptions) -> None:
        self.costs, self.devices, self.bounded, self.options = costs, list(devices), list(bounded), options
        self.names = [d.name for d in devices]
        self.memory = {d.name: d.memory for d in devices if d.memory is not None}
        self.modes = options.modes(len(devices))
        self.ties = [list(members) for members, _ in costs.tie_groups] if options.ties == "colocate" else []
        self.seen: dict[tuple[int, ...], float] = {}

    def __call__(self, cuts: tuple[int, ...]) -> float:
        if cuts not in self.seen:
            self.seen[cuts] = self._score(_assignment(cuts, len(self.costs)))
        return self.seen[cuts]

    def _score(self, assignment: list[int]) -> float:
        if any(len({assignment[m] for m in members}) > 1 for members in self.ties):
            return math.inf
        best = math.inf
        for rule in merge_rules(self.options.schedule):  # as Plan.from_stages picks it
            options = replace(self.options, merge=rule)
            stages = stage_costs(self.costs, assignment, self.devices, options)
            if any(d.memory is not None and s.memory_bytes > d.memory
                   for s, d in zip(stages, self.bounded, strict=True)):
                return math.inf
            sim = simulate_stages(stages, chunks=options.chunks, recompute=self.modes,
                                  ms_per_byte=options.ms_per_byte, schedule=options.schedule,
                                  devices=self.names, merge=rule)
            if any(self.memory.get(name, math.inf) < peak for name, peak in sim.device_memory.items()):
                continue  # the device's whole peak, as the plan will report it
            best = min(best, sim.iteration_time)
        return best


def _baselines(costs: LayerCosts, options: CostOptions, k: int) -> list[list[int]]:
    """The baselines' splits: equal layer counts, DeepSpeed's parameter balance and, where
    torchgpipe is installed, its blockpartition over each layer's work."""
    n = len(costs)
    out = [sizes_to_assignment(uniform_sizes(n, k)), sizes_to_assignment(params_sizes(param_counts(costs), k))]
    work = layer_work(costs.fwd, costs.bwd, min(options.recomputed(k)), options.chunks, costs.recompute_ratio)
    try:
        out.append(sizes_to_assignment(blockpartition_sizes(list(work), k)))
    except PartitionError:  # torchgpipe is not installed
        pass
    return out


def _cuts(assignment: Sequence[int], k: int) -> tuple[int, ...] | None:
    """Where each stage after the first begins, if ``assignment`` is contiguous in layer order
    over all ``k`` stages (else None)."""
    a = list(assignment)
    if not a or a[0] != 0 or a[-1] != k - 1 or any(b - c not in (0, 1) for c, b in zip(a, a[1:], strict=False)):
        return None
    return tuple(i for i in range(1, len(a)) if a[i] != a[i - 1])


def _assignment(cuts: Sequence[int], n: int) -> list[int]:
    return np.searchsorted(np.asarray(cuts, dtype=np.int64), np.arange(n), side="right").tolist()


def _moves(cuts: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Splits one move away: one cut by 1 or 2 layers, or two neighbouring cuts by 1 together."""
    out = []
    shifts: list[tuple[tuple[int, ...], int]] = [((i,), d) for i in range(len(cuts)) for d in (-1, 1, -2, 2)]
    shifts += [((i, i + 1), d) for i in range(len(cuts) - 1) for d in (-1, 1)]
    for moved, d in shifts:
        c = list(cuts)
        for i in moved:
            c[i] += d
        if 0 < c[0] and c[-1] < n and all(x < y for x, y in zip(c, c[1:], strict=False)):
            out.append(tuple(c))
    return out
