"""One given configuration solved: the exact DP, the ILP where it can gain, or a baseline.

``partition()`` (partitioner.py) checks the arguments and resolves the devices; when no choice
is ``"auto"`` it hands the one configuration here (a search goes to search.py instead).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    check_split,
    layer_work,
    resolve_devices,
    schedule_ranks,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan, SolverInfo
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.baselines import (
    blockpartition_sizes,
    kept_whole,
    param_counts,
    params_sizes,
    sizes_to_assignment,
    uniform_sizes,
)
from autopipe.solvers.cbc_log import ProgressLine
from autopipe.solvers.dag_bound import dag_bound, forced_order
from autopipe.solvers.dp import check_stage_count, solve_dp
from autopipe.solvers.ilp import GAP, solve_ilp
from autopipe.solvers.search import ILP_MAX_VARIABLES
from autopipe.solvers.stage_dp import budget_devices
from autopipe.solvers.step_split import shortest, step_split
from executor.spec import check_schedule

__all__ = ["solve_fixed"]


def solve_fixed(profile: Profile, stages: int | None, devices: Sequence[DeviceSpec | str] | None,
                chunks: int, recompute: str | Sequence[str], schedule: str,
                memory_limit: int | str | None, optimizer: str, ties: str, bandwidth: float | None,
                method: str, time_limit: float, progress: bool | None, data_parallel: int,
                dp_mode: str) -> Plan:
    """One given configuration: the exact DP, the ILP where it can gain, or a baseline."""
    specs = resolve_devices(stages, devices, memory_limit)
    options = CostOptions(chunks, recompute if isinstance(recompute, str) else tuple(recompute),
                          optimizer, bandwidth, ties, schedule, data_parallel, dp_mode)
    costs = LayerCosts.from_profile(profile)
    check_split(costs, schedule)  # zero-bubble: "profile again" for a profile without the split
    n, k = len(costs), len(specs)
    check_stage_count(n, k)
    modes = options.modes(k)
    ranks = schedule_ranks(schedule, specs)
    if schedule != "gpipe":
        try:
            check_schedule(schedule, k, ranks or k, chunks)
        except ValueError as err:
            raise PartitionError(str(err)) from None
    bounded = budget_devices(specs, schedule)  # [Note: interleaved memory]
    common: dict[str, Any] = dict(devices=specs, chunks=chunks, recompute=modes, optimizer=optimizer,
                                  bandwidth=bandwidth, ties=ties, schedule=schedule,
                                  data_parallel=data_parallel, dp_mode=dp_mode)

    layers = profile.layers  # a list built from the table on every read

    def plan(assignment: Sequence[int], name: str, solver: SolverInfo | None = None) -> Plan:
        split = [[layers[v] for v in range(n) if assignment[v] == s] for s in range(k)]
        return Plan.from_stages(profile, split, method=name, solver=solver, **common)

    if method in ("uniform", "params", "blockpartition"):
        if method == "uniform":
            sizes = uniform_sizes(n, k)
        elif method == "params":
            sizes = params_sizes(param_counts(costs), k)
        else:
            work = layer_work(costs.fwd, costs.bwd, min(options.recomputed(k)), chunks,
                              costs.recompute_ratio)
            sizes = blockpartition_sizes(list(work), k)
        return plan(sizes_to_assignment(kept_whole(sizes, costs.forbidden_cuts(ties), method)), method)

    start = time.perf_counter()
    dp = solve_dp(costs, bounded, options)
    dp_info = _exact_info(costs, bounded, options, dp.bottleneck, method not in ("exact", "step"), start)
    # CBC overruns its time limit at the root of a large model: auto keeps to what builds in seconds
    large = n * (k - 1) > ILP_MAX_VARIABLES
    if method == "step":  # [Note: the step, not the bottleneck] in step_split.py
        return plan(*step_split(costs, specs, bounded, options, dp.assignment, dp_info))
    if method == "exact" or (method == "auto" and (dp_info.status == "optimal" or large)):
        best = plan(dp.assignment, "exact", dp_info)
        return shortest(best, plan, costs, specs, bounded, options, dp.assignment, dp_info) if method == "auto" else best
    line = ProgressLine(time_limit, progress)  # [Note: progress on a terminal]
    try:
        ilp = solve_ilp(costs, bounded, options, warm_start=dp.assignment, time_limit=time_limit,
                        on_progress=line if line.enabled else None, bound=dp_info.bound)
    finally:
        line.close()
    info = SolverInfo(ilp.status, ilp.objective, ilp.bound, ilp.gap,
                      dp_info.seconds + ilp.seconds)
    if method == "auto" and ilp.objective >= dp.bottleneck * (1 - 1e-9):
        best = plan(dp.assignment, "exact", info)  # the ILP proved (or failed to beat) the DP
    else:
        best = plan(ilp.assignment, "ilp", info)
    return shortest(best, plan, costs, specs, bounded, options, dp.assignment, dp_info) if method == "auto" else best


def _exact_info(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions,
                bottleneck: float, bounded: bool, start: float) -> SolverInfo:
    """What the DP's split is proven to be over the DAG ([Note: when the ILP can gain]):
    optimal when the order is the only one or (``bounded``) within the ILP's gap of the bound."""
    if forced_order(costs):
        return SolverInfo("optimal", bottleneck, bottleneck, 0.0, time.perf_counter() - start)
    bound = dag_bound(costs, devices, options) if bounded else None
    gap = None if bound is None or bottleneck <= 0 else max(0.0, (bottleneck - bound) / bottleneck)
    status = "optimal" if gap is not None and gap <= GAP else "optimal over the topological order"
    return SolverInfo(status, bottleneck, bound, gap, time.perf_counter() - start)
