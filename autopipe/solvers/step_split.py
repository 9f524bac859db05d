"""The split with the shortest simulated step, for one configuration: exact where every split
can be bounded or simulated, else a descent over the cuts, with the gap to a proven bound.

    best = fastest_step(costs, devices, bounded, options, seeds=[dp.assignment])
    best.assignment, best.iteration, best.exhaustive, best.bound, best.gap

[Note: the step, not the bottleneck] A user pays for the step: the simulated iteration of the
plan's own schedule. The min-max DP (autopipe.solvers.dp) minimises the slowest stage; under
1F1B, interleaved 1F1B and the zero-bubble schedules a split whose slowest stage is a little
slower can fill the pipeline's warm-up and cool-down better, and even under GPipe, whose step is
the sum of the stages plus M - 1 times the slowest forward and the slowest backward, the DP's
split (one of several with the same slowest stage) was up to 1% slower than the fastest. So for
one configuration (stages, devices, micro-batches, recomputation, schedule) the planner scores
contiguous splits of the topological order by the simulator itself (``stage_costs`` then
``simulate_stages``, under each merge rule the schedule has), under the DP's memory rule (each
stage within its device's budget, [Note: interleaved memory]) and each device's simulated peak
within its memory, as the plan reports it (tied layers together when ``ties="colocate"``). The
batch of splits ([Note: steps in a batch] in split_steps.py) gives every split's step at once
where each device runs a queue of its own, without the data-parallel collectives: a lower bound,
and the step itself for one replica; where nothing else is checked (no memory limit, no ties
kept together) it is the score and nothing is simulated.

- Where splits x operations is at most ``BOUNDED_WORK``, every split is bounded and they are
  scored from the lowest bound on until the next bound is no lower than the best step (at most
  ``BOUNDED_SIMULATIONS`` simulated; cut short, the next bound is what the rest cannot beat); else
  where the splits number at most ``ENUMERATE_SPLITS``, every one is simulated. The step is then
  optimal over the topological order (optimal outright for a chain, whose order is the only one).
- Else a descent from each seed (the caller's, the DP's, and the baselines': equal layer counts,
  parameters, torchgpipe's blockpartition): with the batch, the lowest-bounded of the moves of
  one cut by up to 16 layers and of two neighbouring cuts together, and at a local minimum of
  those, of any two cuts by up to ``_reach`` layers each; without it, the first shorter move of
  one cut or two by one or two layers. Its gap is stated against ``config_bound`` and, under GPipe
  and 1F1B, ``pipeline_bound`` (autopipe/solvers/bounds.py), which no split beats.

It never returns a split slower than its seeds, so never slower than the DP's or a baseline's.
``method="step"`` asks for it; ``method="auto"`` (the default) takes it under every schedule
(:func:`shortest` for one configuration, with budgets of time, ``auto_budget``; the automatic
search for each schedule's best configuration, search.py) where it is faster than the DP's (or
the ILP's) split, or where its search was not exhaustive, so that the plan states the gap.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from autopipe.core.cost import DeviceSpec, LayerCosts, layer_work, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan, SolverInfo
from autopipe.core.simulator import simulate_stages
from autopipe.errors import PartitionError
from autopipe.solvers.baselines import (
    blockpartition_sizes,
    kept_whole,
    param_counts,
    params_sizes,
    sizes_to_assignment,
    uniform_sizes,
)
from autopipe.solvers.bounds import config_bound, pipeline_bound
from autopipe.solvers.dag_bound import forced_order
from autopipe.solvers.split_steps import SplitSteps
from executor.spec import merge_rules

__all__ = ["StepSplit", "fastest_step", "step_split", "shortest", "ENUMERATE_SPLITS", "DESCENT_EVALUATIONS"]

ENUMERATE_SPLITS = 500  # every split simulated when there are at most this many (no batch bound)
DESCENT_EVALUATIONS = 120  # splits a descent simulates at most
# With the batch bound ([Note: steps in a batch]): every split bounded where splits x operations
# is at most BOUNDED_WORK (about a second of numpy here) and the splits at most BOUNDED_SPLITS,
# BOUNDED_BLOCK operations x splits at a time; at most BOUNDED_SIMULATIONS simulated; a split
# whose bound is within BOUND_TOLERANCE of the best step is ruled out (the step found is the
# fastest to that relative tolerance).
BOUNDED_WORK = 30_000_000
BOUNDED_SPLITS = 1_000_000
BOUNDED_BLOCK = 1_000_000
BOUNDED_SIMULATIONS = 500
BOUND_TOLERANCE = 1e-9
NEAR_SHIFTS = (1, 2)  # a descent's moves of one cut, in layers
WIDE_SHIFTS = (1, 2, 3, 4, 6, 8, 12, 16)  # the same where the batch bound ranks the moves
MOVE_WORK = 2_000_000  # moves x operations of a descent's far moves (see _reach)
FAR_MOVES = 4096  # and at most this many
# A walk of the batch over C splits costs about operations x (C + WALK_OVERHEAD) units (~6 ns a
# unit here); a descent walks at most DESCENT_WALK_WORK units (~4 s), AUTO_WALK_WORK (~0.4 s)
# under method="auto".
WALK_OVERHEAD = 333
DESCENT_WALK_WORK = 600_000_000
AUTO_WALK_WORK = 60_000_000
# Under method="auto" a descent that simulates (under a memory limit) simulates at most
# AUTO_STEP_WORK terms' worth, at least AUTO_MIN_EVALUATIONS splits: a split simulated costs about
# N x K layer x stage terms plus SIMULATED_OPERATION terms for each operation (~2.5 us a term).
AUTO_STEP_WORK = 150_000
AUTO_MIN_EVALUATIONS = 4
SIMULATED_OPERATION = 10


def auto_budget(layers: int, stages: int, operations: int) -> tuple[int, int]:
    """method="auto"'s budgets for a descent over ``layers`` into ``stages`` whose schedule runs
    ``operations`` per split: splits simulated, and units of batch walks."""
    simulated = layers * stages + SIMULATED_OPERATION * operations
    return min(DESCENT_EVALUATIONS, max(AUTO_MIN_EVALUATIONS, AUTO_STEP_WORK // simulated)), AUTO_WALK_WORK


@dataclass(frozen=True)
class StepSplit:
    """The fastest split found: each layer's stage, its simulated iteration (ms), whether every
    split was scored, the bound no split beats (ms), the splits simulated, and how it searched."""

    assignment: list[int]
    iteration: float
    exhaustive: bool
    bound: float
    evaluated: int
    search: str  # "every split", "every split bounded", or what it scored when not every split

    @property
    def gap(self) -> float:
        return 0.0 if self.exhaustive or self.iteration <= 0 else max(0.0, 1 - self.bound / self.iteration)


def fastest_step(costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
                 options: CostOptions, seeds: Sequence[Sequence[int]], auto: bool = False) -> StepSplit | None:
    """The contiguous split of ``costs``' layers over ``devices`` with the shortest simulated
    step under ``options`` ([Note: the step, not the bottleneck]); ``bounded``: the devices whose
    memory each stage must fit (the DP's); ``auto``: a descent within method="auto"'s budgets
    (``auto_budget``), else DESCENT_EVALUATIONS and DESCENT_WALK_WORK. None when no seed is a
    contiguous split that fits."""
    n, k = len(costs), len(devices)
    steps = SplitSteps.of(costs, devices, options) if k > 1 else None
    step = _Scorer(costs, devices, bounded, options, steps)
    seeds = [*seeds, *_baselines(costs, options, k)]
    starts = _starts(step, [c for c in (_cuts(s, k) for s in seeds) if c is not None])
    if not starts:
        return None
    best = min(starts, key=lambda c: (step(c), c))
    splits = math.comb(n - 1, k - 1)
    if steps is not None and splits * steps.operations <= BOUNDED_WORK and splits <= BOUNDED_SPLITS:
        return _bounded(step, steps, best, n, k, splits)
    if splits <= ENUMERATE_SPLITS:
        best = min(itertools.combinations(range(1, n), k - 1), key=lambda c: (step(c), c))
        return StepSplit(_assignment(best, n), step(best), True, step(best), step.simulated, "every split")
    evaluations, walks = (auto_budget(n, k, steps.operations if steps else SIMULATED_OPERATION * n) if auto
                          else (DESCENT_EVALUATIONS, DESCENT_WALK_WORK))
    budget = [walks]
    ends = [_descend(step, start, n, evaluations, budget) for start in sorted(set(starts), key=step)]
    best = min(ends, key=lambda c: (step(c), c))
    return StepSplit(_assignment(best, n), step(best), False, min(_bound(costs, devices, options), step(best)),
                     step.simulated, f"descent over {len(step.weighed | set(step.seen))} splits ({step.simulated} simulated)")


def _bound(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> float:
    """What no split of the configuration beats: the larger of the totals' bound and, under
    GPipe and 1F1B, the pipeline's (autopipe/solvers/bounds.py)."""
    return max(config_bound(options.schedule, costs, [d.speed for d in devices], options.chunks),
               pipeline_bound(costs, devices, options) or 0.0)


def _starts(step: _Scorer, seeds: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The seeds that fit, each a start of the descent; where they must be simulated, only those
    whose batch bound is below the step of the lowest-bounded one that fits."""
    lows = step.bound_all(seeds)
    if step.steps is None or step.free:
        return [c for c in seeds if step(c) < math.inf]
    out: list[tuple[int, ...]] = []
    for i in np.argsort(lows, kind="stable"):
        if out and lows[i] >= step(out[0]):
            break
        if step(seeds[i]) < math.inf:
            out.append(seeds[i])
    return out


def _bounded(step: _Scorer, steps: SplitSteps, best: tuple[int, ...], n: int, k: int, splits: int) -> StepSplit:
    """Every split ranked by its batch bound ([Note: steps in a batch]) and scored from the lowest
    on, until the next bound is no lower than the best step (the best is then the fastest) or
    ``BOUNDED_SIMULATIONS`` splits were simulated (no split left beats that next bound)."""
    cuts = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(1, n), k - 1)),
                       dtype=np.int32, count=splits * (k - 1)).reshape(splits, k - 1)
    rows = max(1, BOUNDED_BLOCK // steps.operations)
    lows = np.concatenate([steps(cuts[i:i + rows]) for i in range(0, splits, rows)])
    for index in np.argsort(lows, kind="stable"):
        if lows[index] >= step(best) * (1 - BOUND_TOLERANCE):
            break
        if step.simulated >= BOUNDED_SIMULATIONS:  # the rest no faster than this bound
            bound = max(min(float(lows[index]), step(best)), _bound(step.costs, step.devices, step.options))
            return StepSplit(_assignment(best, n), step(best), False, bound, step.simulated,
                             f"{step.simulated} of {splits} splits simulated, the rest bounded")
        cut = tuple(int(x) for x in cuts[index])
        step.known(cut, float(lows[index]))
        if step(cut) < step(best):
            best = cut
    return StepSplit(_assignment(best, n), step(best), True, step(best), step.simulated, "every split bounded")


def step_split(costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
               options: CostOptions, seed: list[int], info: SolverInfo,
               auto: bool = False) -> tuple[list[int], str, SolverInfo]:
    """method="step": the split with the shortest simulated step, seeded by ``seed`` (the DP's)
    and the baselines' splits, with what is proven of it; ``seed`` and ``info`` when no seed fits."""
    start = time.perf_counter()
    found = fastest_step(costs, devices, bounded, options, [seed], auto)
    if found is None:
        return seed, "step", info
    seconds = info.seconds + time.perf_counter() - start
    if found.exhaustive:
        status = "optimal" if forced_order(costs) else "optimal over the topological order"
        return found.assignment, "step", SolverInfo(status, found.iteration, found.iteration, 0.0, seconds)
    return found.assignment, "step", SolverInfo(found.search, found.iteration, found.bound, found.gap, seconds)


def shortest(best: Plan, plan: Callable[[list[int], str, SolverInfo], Plan], costs: LayerCosts,
             devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec], options: CostOptions,
             seed: list[int], info: SolverInfo) -> Plan:
    """method="auto": the split with the shortest simulated step ([Note: the step, not the
    bottleneck]; ``plan`` builds a Plan of an assignment) where it is shorter than ``best``'s (the
    slowest stage's optimum, or the ILP's), or where its search was not exhaustive and it is no
    longer (so the plan states the step's gap); else ``best``."""
    step = plan(*step_split(costs, devices, bounded, options, seed, info, auto=True))
    if step.iteration_time < best.iteration_time * (1 - 1e-9):
        return step
    searched = step.method == "step" and step.solver.gap is not None and step.solver.gap > 0
    return step if searched and step.iteration_time <= best.iteration_time * (1 + 1e-9) else best


def _descend(step: _Scorer, cuts: tuple[int, ...], n: int, evaluations: int, walk: list[int]) -> tuple[int, ...]:
    """From ``cuts``, a shorter step one move away while there is one and the budgets last
    (``evaluations`` splits simulated and ``walk[0]`` units of batch walks, every seed's descent
    together). With the batch bound ([Note: steps in a batch]) the wide moves, the lowest bound
    first and none whose bound is no shorter, and where none is shorter the far ones (``_reach``);
    without it the first shorter near move."""
    far = False
    while True:
        current = step(cuts)
        if step.steps is not None:
            moves = _moves(cuts, n, WIDE_SHIFTS, _reach(len(cuts), step.steps.operations) if far else 0)
            walk[0] -= step.steps.operations * (len(moves) + WALK_OVERHEAD)
            if walk[0] < 0:
                return cuts
            lows = step.bound_all(moves)
            moves = [moves[i] for i in np.argsort(lows, kind="stable") if lows[i] < current * (1 - 1e-12)]
        else:
            moves = _moves(cuts, n, NEAR_SHIFTS)
        for move in moves:
            if step.simulated >= evaluations and not step.cached(move):
                return cuts
            if step(move) < current * (1 - 1e-12):
                cuts, far = move, False
                break
        else:
            if step.steps is None or far:
                return cuts
            far = True


def _reach(cuts: int, operations: int) -> int:
    """How far a descent's two-cut moves reach: every pair of cuts moved by up to this many
    layers each, about MOVE_WORK / operations moves in all, at most FAR_MOVES (at least 1 layer)."""
    pairs = max(1, cuts * (cuts - 1) // 2)
    return max(1, int((math.sqrt(min(FAR_MOVES, MOVE_WORK / operations) / pairs)) / 2))


class _Scorer:
    """A split's simulated iteration (ms; inf when a stage does not fit), each scored once; where
    the batch bound equals the simulated step and nothing is checked (one replica, no memory
    limit, no ties kept together), the bound itself ([Note: steps in a batch])."""

    def __init__(self, costs: LayerCosts, devices: Sequence[DeviceSpec], bounded: Sequence[DeviceSpec],
                 options: CostOptions, steps: SplitSteps | None) -> None:
        self.costs, self.devices, self.bounded, self.options = costs, list(devices), list(bounded), options
        self.steps = steps
        self.names = [d.name for d in devices]
        self.memory = {d.name: d.memory for d in devices if d.memory is not None}
        self.modes = options.modes(len(devices))
        self.ties = [list(members) for members in costs.kept_together(options.ties)]
        self.free = (steps is not None and steps.exact and not self.memory and not self.ties
                     and all(d.memory is None for d in bounded))
        self.seen: dict[tuple[int, ...], float] = {}
        self.weighed: set[tuple[int, ...]] = set()  # bounded or scored
        self.simulated = 0

    def known(self, cuts: tuple[int, ...], low: float) -> None:
        """``low``, the batch bound of ``cuts``: its step where the bound is the step."""
        if self.free:
            self.seen.setdefault(cuts, low)

    def bound_all(self, splits: Sequence[tuple[int, ...]]) -> np.ndarray:
        """The batch bounds of ``splits`` in one walk (none without the batch), each kept as its
        step where the bound is the step."""
        if self.steps is None or not splits:
            return np.zeros(0)
        lows = self.steps(np.array(splits))
        self.weighed.update(splits)
        for cuts, low in zip(splits, lows, strict=True):
            self.known(cuts, float(low))
        return lows

    def cached(self, cuts: tuple[int, ...]) -> bool:
        return cuts in self.seen

    def __call__(self, cuts: tuple[int, ...]) -> float:
        if cuts not in self.seen:
            if self.free and self.steps is not None:
                self.seen[cuts] = float(self.steps(np.array([cuts]))[0])
            else:
                self.simulated += 1
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
    forbidden = costs.forbidden_cuts(options.ties)
    work = layer_work(costs.fwd, costs.bwd, min(options.recomputed(k)), options.chunks, costs.recompute_ratio)
    out = []
    for name, sizes in (("uniform", lambda: uniform_sizes(n, k)), ("params", lambda: params_sizes(param_counts(costs), k)),
                        ("blockpartition", lambda: blockpartition_sizes(list(work), k))):
        try:  # (blockpartition: where torchgpipe is installed; none that must cut a group)
            out.append(sizes_to_assignment(kept_whole(sizes(), forbidden, name)))
        except PartitionError:
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


def _moves(cuts: tuple[int, ...], n: int, shifts: tuple[int, ...], reach: int = 0) -> list[tuple[int, ...]]:
    """Splits one move away (:func:`_deltas`) that keep every stage non-empty."""
    moved = np.asarray(cuts, dtype=np.int64) + _deltas(len(cuts), shifts, reach)
    ok = (moved[:, 0] > 0) & (moved[:, -1] < n) & (np.diff(moved, axis=1) > 0).all(axis=1)
    return [tuple(row) for row in moved[ok].tolist()]


@lru_cache(maxsize=64)
def _deltas(cuts: int, shifts: tuple[int, ...], reach: int) -> np.ndarray:
    """The moves of ``cuts`` cuts: one cut by any of ``shifts`` layers either way; two
    neighbouring cuts together by 1 or 2; and any two cuts by up to ``reach`` layers each (a
    stage's layers passed to a stage far off, or to another stage of the same rank)."""
    rows: list[tuple[tuple[int, int], ...]] = [((i, d),) for i in range(cuts) for s in shifts for d in (-s, s)]
    rows += [((i, d), (i + 1, d)) for i in range(cuts - 1) for d in (-1, 1, -2, 2)]
    span = range(-reach, reach + 1)
    rows += [((i, di), (j, dj)) for i, j in itertools.combinations(range(cuts), 2) for di in span for dj in span
             if di and dj]
    out = np.zeros((len(rows), cuts), dtype=np.int64)
    for r, pairs in enumerate(rows):
        for i, d in pairs:
            out[r, i] += d
    return np.unique(out, axis=0)
