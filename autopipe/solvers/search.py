"""The automatic search: stages, micro-batches, recomputation and schedule, by simulated time.

[Note: automatic search] ``partition(stages="auto", chunks="auto", recompute="auto",
schedule="auto")`` (any of them) picks the configuration whose SIMULATED iteration
(autopipe.core.simulator, the schedule's own order) is shortest among those that fit every
device's memory. The bottleneck stays a reported figure, not the target. A configuration is

    ranks W      devices used: 1 .. len(devices) for stages="auto" (the W fastest, then
                 roomiest, in the given order); ``gpipe`` / ``1f1b`` run W stages, one per
                 rank, the multi-stage schedules (``interleaved1f1b``, ``interleaved_zb``, the V
                 of ``zbv`` and ``dualpipev``) INTERLEAVED_PER_RANK stages on each (W >= 2)
                 as executor.spec.stage_rank places them (autopipe/solvers/search_space.py);
                 a fixed stages=K is K stages under every schedule (K / 2 ranks multi-stage)
    chunks M     micro-batches per mini-batch: the divisors of batch_size up to max_chunks for
                 chunks="auto" (equal micro-batches, which every runtime accepts), with the
                 profile scaled to ceil(B / M) rows ([Note: micro-batch scaling])
    schedule     all six of executor.spec.SCHEDULES for schedule="auto"; only counts the
                 runtime accepts (executor.spec.check_schedule); the zero-bubble ones only for
                 a profile with a split backward, each left out with its reason otherwise
                 (``plan.skipped_schedules``, said by plan.explain())
    checkpoint   per stage: the per-stage DP ([Note: per-stage mode DP]) with every mode
                 allowed, AND each single mode for all stages, so the result is never slower
                 (simulated) than any single-mode plan it searched; where no mode fits, blocks
                 recomputed alone ([Note: blocks recomputed alone] in block_recompute.py)

Each configuration's split is the exact min-max DP over the topological order; the simulator then
times it; under method="auto" each schedule's best configuration is split again for its shortest
step where one can beat the best ([Note: the step, not the bottleneck]); plan.explain() lists the
next best configurations and the best of every schedule weighed, and ``plan.solver`` the gap to the
least bound over every configuration of the space. A lower bound on the iteration of every
configuration, from totals only (``config_bound``), orders the work and prunes: configurations are
solved from the most promising on, and the search stops when the next bound is no better than the
best simulated time, so pruning never changes the answer (autopipe.solvers.bounds). Identical
devices under gpipe / 1f1b solve every W in one DP pass (``stage_dp.solve_counts``). The ILP refines
only the winner, only for a DAG whose DP split is more than its gap above the bound on every DAG
split ([Note: when the ILP can gain] in autopipe/solvers/dag_bound.py), and only when it is small
enough to build in seconds (``ILP_MAX_VARIABLES``) or the method is "ilp": on DAGs of hundreds of
layers it ran for tens of seconds to minutes to improve on the DP by a fraction of a percent, if at
all (docs/benchmarks.md, "Figures behind the Notes").
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace

from tqdm import tqdm

from autopipe.core.cost import DeviceSpec, LayerCosts, lower_bound, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan, SolverInfo
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at, rows_for
from autopipe.core.simulator import simulate_stages
from autopipe.errors import PartitionError
from autopipe.solvers.block_recompute import block_splits, least_alone
from autopipe.solvers.bounds import config_bound, split_bound
from autopipe.solvers.cbc_log import ProgressLine
from autopipe.solvers.dag_bound import dag_bound, forced_order
from autopipe.solvers.defaults import SEARCH_ILP_TIME_LIMIT
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import GAP, solve_ilp
from autopipe.solvers.layer_recompute import recompute_layers_where_faster
from autopipe.solvers.search_space import (
    INTERLEAVED_PER_RANK,
    Config,
    Result,
    Setting,
    alternatives,
    chunk_candidates,
    plan_devices,
    stages_per_rank,
    unplannable,
)
from autopipe.solvers.search_space import pick_devices as _pick
from autopipe.solvers.stage_dp import Split, StageBlocks, budget_devices, solve_counts, solve_split
from autopipe.solvers.step_split import fastest_step
from executor.spec import RECOMPUTE_MODES, check_schedule, merge_rules

__all__ = ["INTERLEAVED_PER_RANK", "ILP_MAX_VARIABLES", "Setting", "search", "chunk_candidates"]

ILP_MAX_VARIABLES = 1500  # layers x (stages - 1) the search's ILP may have


class _Search:
    def __init__(self, profile: Profile, pool: list[DeviceSpec], setting: Setting,
                 progress: bool | None) -> None:
        self.profile, self.pool, self.setting = profile, pool, setting
        self.progress = progress
        self.n = len(profile)
        self._profiles: dict[int, tuple[Profile, LayerCosts]] = {}
        self._blocks: dict[tuple[int, str], StageBlocks] = {}
        self.results: list[Result] = []
        self.floor: dict[Config, float] = {}  # M x the per-stage DP's bottleneck
        self.solved = 0
        self.skipped = unplannable(setting.schedules, LayerCosts.from_profile(profile))  # and why

    def at(self, m: int) -> tuple[Profile, LayerCosts]:
        """The profile (and its costs) at the micro-batch of M micro-batches."""
        b = self.setting.batch_size
        rows = rows_for(b, m) if b is not None else -1
        if rows not in self._profiles:
            prof = self.profile if b is None else profile_at(self.profile, rows, batch_size=b, chunks=m)
            self._profiles[rows] = (prof, LayerCosts.from_profile(prof))
        return self._profiles[rows]

    def options(self, schedule: str, m: int, recompute: str | tuple[str, ...]) -> CostOptions:
        st = self.setting
        mode = "never" if recompute == "auto" else recompute
        return CostOptions(m, mode, st.optimizer, st.bandwidth, st.ties, schedule, st.data_parallel,
                           st.dp_mode)

    def configs(self) -> list[Config]:
        out = []
        distinct = len({d.name for d in self.pool}) == len(self.pool)
        for schedule in self.setting.schedules:
            if schedule in self.skipped:
                continue
            per_rank = stages_per_rank(schedule)
            ranks = self.setting.ranks
            if per_rank > 1 and self.setting.stages is not None:
                fixed = self.setting.stages
                ranks = [fixed // per_rank] if fixed % per_rank == 0 else []
            for w in ranks:
                k = w * per_rank
                if k > self.n or w > len(self.pool) or (per_rank > 1 and (w < 2 or not distinct)):
                    continue
                speeds = [d.speed for d in _pick(self.pool, w)]
                for m in self.setting.chunks:
                    try:
                        check_schedule(schedule, k, w, m)
                    except ValueError:
                        continue
                    bound = config_bound(schedule, self.at(m)[1], speeds, m)
                    out.append(Config(schedule, w, m, bound))
        return sorted(out, key=lambda c: (c.bound, c.schedule, c.ranks, c.chunks))

    def best_time(self) -> float:
        return min((r.time for r in self.results), default=math.inf)

    def run(self) -> None:
        """Two passes over the configurations, most promising first: the per-stage search (or
        the given checkpoint), then each single mode where it can still win (its bottleneck is
        no lower than the per-stage DP's, so M x that bounds its iteration); then blocks alone."""
        configs = self.configs()
        auto = "auto" in self.setting.checkpoints
        bar = tqdm(total=len(configs) * (2 if auto else 1), desc="search", file=sys.stderr,
                   leave=False, disable=None if self.progress is None else not self.progress)
        try:
            given = [cp for cp in self.setting.checkpoints if cp != "auto"]
            self._pass(configs, ["auto"] if auto else given, bar)
            if auto:
                self._pass(configs, [*RECOMPUTE_MODES, *given], bar)
                self.blocks_alone(configs)
        finally:
            bar.close()

    def blocks_alone(self, configs: list[Config]) -> None:
        """Each configuration no stage mode fits, with blocks recomputed alone ([Note: blocks recomputed alone])."""
        for c in (c for c in configs if self.floor.get(c) == math.inf and c.bound < self.best_time()):
            devices = plan_devices(c.schedule, _pick(self.pool, c.ranks))
            for b in block_splits(self.at(c.chunks)[1], devices, budget_devices(devices, c.schedule),
                                  self.options(c.schedule, c.chunks, "never"), self.blocks(c.schedule, c.chunks)):
                split = Split(b.assignment, max(st.time_ms for st in b.stages), ["never"] * len(devices))
                self.evaluate(c, "never", split, alone=(b.layers, b.starts))

    def _live(self, c: Config, cp: str | tuple[str, ...]) -> bool:
        best = self.best_time()
        if c.bound >= best:
            return False
        if cp != "auto" and "auto" in self.setting.checkpoints:
            if cp == "never" and all(d.memory is None for d in self.pool):
                return False  # without limits 'never' is every stage's fastest: the same DP
            return self.floor.get(c, math.inf) < best
        return True

    def _pass(self, configs: list[Config], variants: list[str | tuple[str, ...]], bar: tqdm) -> None:  # type: ignore[type-arg]
        homogeneous = len({(d.speed, d.memory) for d in self.pool}) == 1
        grouped: set[tuple[str, int]] = set()
        for c in configs:
            if c.bound >= self.best_time():
                break  # every later configuration is bounded no better
            bar.update(1)
            if homogeneous and c.schedule in ("gpipe", "1f1b"):
                if (c.schedule, c.chunks) in grouped:
                    continue
                grouped.add((c.schedule, c.chunks))
                same = [x for x in configs if (x.schedule, x.chunks) == (c.schedule, c.chunks)]
                for cp in variants:
                    if isinstance(cp, str):
                        self.solve_counts(same, cp)
                    else:
                        for x in same:
                            self.solve_one(x, cp)
            else:
                for cp in variants:
                    self.solve_one(c, cp)
            bar.set_postfix_str(f"best {self.best_time():.3f} ms", refresh=False)

    def blocks(self, schedule: str, m: int) -> StageBlocks:
        if (m, schedule) not in self._blocks:
            self._blocks[(m, schedule)] = StageBlocks(self.at(m)[1], self.options(schedule, m, "never"))
        return self._blocks[(m, schedule)]

    def solve_counts(self, same: list[Config], cp: str) -> None:
        """Every stage count of one (schedule, chunks) on identical devices, in one DP pass."""
        live = [c for c in same if self._live(c, cp)]
        if not live:
            return
        c0 = live[0]
        splits = solve_counts(self.at(c0.chunks)[1], self.pool[0],
                              self.options(c0.schedule, c0.chunks, cp), max(c.ranks for c in live),
                              modes=cp, blocks=self.blocks(c0.schedule, c0.chunks))
        self.solved += 1
        for c in live:
            self.found(c, cp, splits.get(c.ranks))

    def solve_one(self, c: Config, cp: str | tuple[str, ...]) -> None:
        devices = plan_devices(c.schedule, _pick(self.pool, c.ranks))
        if not isinstance(cp, str) and len(cp) != len(devices):
            return  # a per-stage list fixes the stage count
        if not self._live(c, cp):
            return
        split = solve_split(self.at(c.chunks)[1], budget_devices(devices, c.schedule),
                            self.options(c.schedule, c.chunks, cp),
                            modes="auto" if cp == "auto" else None,
                            blocks=self.blocks(c.schedule, c.chunks))
        self.solved += 1
        self.found(c, cp, split)

    def found(self, c: Config, cp: str | tuple[str, ...], split: Split | None) -> None:
        if cp == "auto":  # no single mode beats the per-stage DP's bottleneck
            self.floor[c] = math.inf if split is None else c.chunks * split.bottleneck
        if split is not None:
            self.evaluate(c, cp, split)

    def other_schedules(self) -> None:
        """For the alternatives table: each schedule the pruning left unsimulated, at its most
        promising configuration (one more DP each, nothing that changes the choice)."""
        shown = {r.config.schedule for r in self.results}
        first = "auto" if "auto" in self.setting.checkpoints else self.setting.checkpoints[0]
        for schedule in self.setting.schedules:
            configs = [c for c in self.configs() if c.schedule == schedule]
            if schedule in shown or not configs:
                continue
            c = configs[0]  # the lowest bound
            devices = plan_devices(c.schedule, _pick(self.pool, c.ranks))
            if not isinstance(first, str) and len(first) != len(devices):
                continue
            split = solve_split(self.at(c.chunks)[1], budget_devices(devices, c.schedule),
                                self.options(c.schedule, c.chunks, first),
                                modes="auto" if first == "auto" else None,
                                blocks=self.blocks(c.schedule, c.chunks))
            if split is not None:
                self.evaluate(c, first, split, always=True)

    def shorter_steps(self) -> set[int]:
        """Each schedule's best configuration split again for its shortest step
        where a split can beat the best ([Note: the step, not the bottleneck]); the ids of the
        results that did, each evaluated beside its DP split's."""
        out: set[int] = set()
        firsts: dict[str, Result] = {}
        for r in sorted(self.results, key=lambda r: r.time):
            if not r.alone[0]:  # [Note: blocks recomputed alone]: their split is not the DP's to improve
                firsts.setdefault(r.config.schedule, r)
        for r in firsts.values():
            c, costs = r.config, self.at(r.config.chunks)[1]
            devices = plan_devices(c.schedule, _pick(self.pool, c.ranks))
            if config_bound(c.schedule, costs, [d.speed for d in devices], c.chunks) >= self.best_time():
                continue  # no split of it beats the best
            opts = replace(self.options(c.schedule, c.chunks, r.recompute), recompute=tuple(r.split.modes))
            found = fastest_step(costs, devices, budget_devices(devices, c.schedule), opts, [r.split.assignment],
                                 auto=True)
            if found is not None and found.iteration < r.time * (1 - 1e-9):
                times = [st.time_ms for st in stage_costs(costs, found.assignment, devices, opts)]
                self.evaluate(c, r.recompute, Split(found.assignment, max(times), r.split.modes), always=True)
                out.add(id(self.results[-1]))
        return out

    def evaluate(self, c: Config, cp: str | tuple[str, ...], split: Split, always: bool = False,
                 alone: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> None:
        costs = self.at(c.chunks)[1]
        devices = plan_devices(c.schedule, _pick(self.pool, c.ranks))
        opts = replace(self.options(c.schedule, c.chunks, cp), recompute=tuple(split.modes),
                       recompute_layers=alone[0], segment_starts=alone[1])
        stages = stage_costs(costs, split.assignment, devices, opts)
        bound = split_bound(c.schedule, [st.time_ms for st in stages], c.chunks, c.ranks)
        if bound >= self.best_time() and not always:
            return  # cannot beat the best: no need to simulate it
        best: Result | None = None
        for rule in merge_rules(c.schedule):
            if rule != opts.merge:  # the halves merged otherwise: other activation terms
                stages = stage_costs(costs, split.assignment, devices, replace(opts, merge=rule))
            sim = simulate_stages(stages, chunks=c.chunks, recompute=split.modes, schedule=c.schedule,
                                  ms_per_byte=opts.ms_per_byte, devices=[d.name for d in devices], merge=rule)
            fits = all(d.memory is None or sim.device_memory[d.name] <= d.memory for d in devices)
            if (best is None or sim.iteration_time < best.time) and (fits or not alone[0]):
                best = Result(c, cp, split, sim.iteration_time, max(sim.device_memory.values()), rule, alone)
        self.results += [best] if best is not None else []

    def infeasible(self) -> PartitionError:
        """No configuration fits: the one-line memory error of the roomiest one searched."""
        c = max(self.configs(), key=lambda x: (stages_per_rank(x.schedule) == 1, x.ranks, x.chunks),
                default=None)
        if c is None:
            return PartitionError(
                f"no configuration to search: {self.n} layers, stages {self.setting.ranks}, chunks "
                f"{self.setting.chunks}, schedules {self.setting.schedules} (each schedule's "
                f"stage and micro-batch rules: executor.spec.check_schedule); widen the choices")
        devices = budget_devices(plan_devices(c.schedule, _pick(self.pool, c.ranks)), c.schedule)
        try:
            solve_dp(self.at(c.chunks)[1], devices, self.options(c.schedule, c.chunks, "always"))
        except PartitionError as err:
            alone = least_alone(self.at(c.chunks)[1], devices, self.options(c.schedule, c.chunks, "never"))
            return PartitionError(f"no searched configuration fits the memory; with {c.ranks} "
                                  f"device(s), {c.chunks} micro-batches, {c.schedule}: {err}{alone}")
        return PartitionError("no searched configuration fits the memory limits; raise them")


def search(profile: Profile, pool: list[DeviceSpec], setting: Setting, *, method: str,
           time_limit: float | None, progress: bool | None) -> Plan:
    """The fastest (simulated) configuration of ``setting`` on ``pool``: see [Note: automatic
    search]. Raises PartitionError in one line when nothing fits."""
    start = time.perf_counter()
    s = _Search(profile, pool, setting, progress)
    s.run()
    if not s.results:
        raise s.infeasible()
    s.other_schedules()
    stepped = s.shorter_steps() if method == "auto" else set()
    ranked = sorted(s.results, key=lambda r: (r.time, r.config.ranks, r.config.chunks))
    best = ranked[0]
    c = best.config
    prof, costs = s.at(c.chunks)
    devices = plan_devices(c.schedule, _pick(pool, c.ranks))
    name = "heuristic" if best.alone[0] else "step" if id(best) in stepped else "exact"
    assignment, info = best.split.assignment, None
    gain = None if best.alone[0] else _refine(costs, devices, best, setting, method, time_limit, progress)
    if gain is not None:
        assignment, name, info = gain
    others = alternatives(ranked[1:], best, setting.data_parallel)  # each schedule's best too
    layers = prof.layers
    stages = [[layers[v] for v in range(len(assignment)) if assignment[v] == st]
              for st in range(len(devices))]
    seconds = time.perf_counter() - start
    status = f"best of {len(s.results)} simulated configurations ({s.solved} DP solves)"
    if best.alone[0]:  # [Note: blocks recomputed alone]: a few splits tried, none proven the best
        status = f"heuristic: no stage mode fits, blocks recomputed alone on a split not proven optimal; {status}"
    plan = Plan.from_stages(prof, stages, devices=devices, chunks=c.chunks, recompute=best.split.modes,
                            optimizer=setting.optimizer, bandwidth=setting.bandwidth, ties=setting.ties,
                            method=name, solver=replace(info or SolverInfo(status), seconds=seconds),
                            schedule=c.schedule, alternatives=others, data_parallel=setting.data_parallel,
                            dp_mode=setting.dp_mode, skipped_schedules=s.skipped, recompute_layers=best.alone[0],
                            segment_starts=best.alone[1])
    if "auto" in setting.checkpoints:  # [Note: recomputed layers]: a few layers, not a stage
        plan = recompute_layers_where_faster(plan, prof)
    if info is not None:
        return plan  # the ILP's, with its own gap
    # what is proven of the whole space: no configuration of it iterates faster than its bound
    t, bound = plan.iteration_time, min(x.bound for x in s.configs())
    return replace(plan, solver=SolverInfo(status, t, bound, max(0.0, 1 - bound / t) if t > 0 else 0.0, seconds))


def _refine(costs: LayerCosts, devices: list[DeviceSpec], best: Result, setting: Setting,
            method: str, time_limit: float | None, progress: bool | None
            ) -> tuple[list[int], str, SolverInfo] | None:
    """The ILP on the winner's configuration, where it can gain ([Note: automatic search])."""
    c = best.config
    k = len(devices)
    if method not in ("auto", "ilp") or k == 1 or forced_order(costs):
        return None  # the order is the DAG's only one: the DP's split is exact
    opts = CostOptions(c.chunks, tuple(best.split.modes), setting.optimizer, setting.bandwidth,
                       setting.ties, c.schedule, setting.data_parallel, setting.dp_mode)
    work = costs.fwd + costs.bwd
    bound = max(lower_bound(work, [d.speed for d in devices], costs.call_ms(c.schedule)),
                dag_bound(costs, devices, opts) or 0.0)
    if best.split.bottleneck <= (1 + GAP) * bound:
        return None  # within the ILP's gap of a bound no split beats
    if method == "auto" and len(costs) * (k - 1) > ILP_MAX_VARIABLES:
        return None
    budget = SEARCH_ILP_TIME_LIMIT if time_limit is None else time_limit
    line = ProgressLine(budget, progress)
    try:
        ilp = solve_ilp(costs, budget_devices(devices, c.schedule), opts,
                        warm_start=best.split.assignment, time_limit=budget,
                        on_progress=line if line.enabled else None, bound=bound)
    finally:
        line.close()
    info = SolverInfo(ilp.status, ilp.objective, ilp.bound, ilp.gap, ilp.seconds)
    if ilp.objective >= best.split.bottleneck * (1 - 1e-9):
        return best.split.assignment, "exact", info
    opts = replace(opts, merge=best.merge)
    stages = stage_costs(costs, ilp.assignment, devices, opts)
    sim = simulate_stages(stages, chunks=c.chunks, recompute=best.split.modes, schedule=c.schedule,
                          ms_per_byte=opts.ms_per_byte, devices=[d.name for d in devices], merge=best.merge)
    if sim.iteration_time < best.time:
        return ilp.assignment, "ilp", info
    return best.split.assignment, "exact", info
