"""Balance a profile's layers into pipeline stages: ``autopipe.partition(profile, stages=K)``.

    dp.py         exact min-max split of the layers' topological order (memory, speeds, ties)
    ilp.py        PuLP/CBC over the whole DAG, warm-started from the DP
    cbc_log.py    CBC's log read as it is written: bound, incumbent and gap, live
    baselines.py  equal layer counts, DeepSpeed's parameter balance, torchgpipe's blockpartition
    synthetic.py  deterministic chain / transformer-DAG profiles for tests and benchmarks

``autopipe.partition`` is the function, not this package: see [Note: functions named like
submodules] in autopipe/__init__.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from autopipe.core.cost import (
    CostOptions,
    DeviceSpec,
    LayerCosts,
    layer_work,
    resolve_devices,
)
from autopipe.core.plan import Plan, SolverInfo
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError
from autopipe.solvers.baselines import (
    blockpartition_sizes,
    params_sizes,
    sizes_to_assignment,
    uniform_sizes,
)
from autopipe.solvers.cbc_log import ProgressLine
from autopipe.solvers.dp import check_stage_count, solve_dp
from autopipe.solvers.ilp import solve_ilp
from executor.spec import recomputed_microbatches

__all__ = ["METHODS", "partition", "is_chain"]

METHODS: tuple[str, ...] = ("auto", "dp", "ilp", "uniform", "params", "blockpartition")


def is_chain(profile: Profile) -> bool:
    """True when every layer feeds only the next one (no branches, no skips)."""
    index = {name: i for i, name in enumerate(profile.layers)}
    return all(index[dst] == index[src] + 1 for src, dst, _ in profile.edges)


def partition(
    profile: Profile,
    *,
    stages: int | None = None,
    devices: Sequence[DeviceSpec | str] | None = None,
    method: str = "auto",
    chunks: int | None = None,
    checkpoint: str = "except_last",
    memory_limit: int | str | None = None,
    optimizer: str = "adam",
    time_limit: float = 60,
    ties: str = "share",
    bandwidth: float | None = 10e9,
    progress: bool | None = None,
) -> Plan:
    """Split ``profile``'s layers into ``stages`` (or ``len(devices)``) balanced pipeline stages.

    Minimises the bottleneck stage time (forward + backward + recompute, over the device's
    relative speed, plus transfers at its cuts; see autopipe.core.cost) subject to each device's
    memory (``DeviceSpec.memory`` or ``memory_limit``, e.g. ``"16GiB"``).

    method: ``dp`` (exact over the topological order), ``ilp`` (exact over the DAG, PuLP/CBC,
    bounded by ``time_limit`` seconds), ``auto`` (DP for chains, ILP otherwise, keeping the DP
    split if the ILP does not beat it in time), or a baseline: ``uniform``, ``params``,
    ``blockpartition`` (torchgpipe). ``ties``: ``share`` charges a tied parameter to every stage
    using it, ``colocate`` keeps each tie group on one stage. ``bandwidth`` in bytes/s between
    neighbouring stages (None or 0: free). ``chunks`` defaults to the number of micro-batches
    the profile was measured for (its ``meta["chunks"]``), else 8: the plan's fingerprint is the
    profiled micro-batch's, so that is the pipeline it fits. Given ``stages`` and no ``devices``,
    each stage gets its own device of the kind the profile was measured on (``cpu:0``,
    ``cpu:1``, ...; ``stage0``, ... when the profile does not say). ``progress``: the ILP's best split,
    bound and gap on stderr as they improve; None (default) shows them when stderr is a terminal,
    True always, False never. Raises PartitionError when no split fits.
    """
    if not isinstance(profile, Profile):
        raise PartitionError(f"partition needs an autopipe.Profile, got {type(profile).__name__}; "
                             f"load one with autopipe.Profile.load(path)")
    if method not in METHODS:
        raise PartitionError(f"method={method!r} is unknown; choose one of {list(METHODS)}")
    if progress is not None and not isinstance(progress, bool):
        raise PartitionError(f"progress must be True, False or None (shown when stderr is a "
                             f"terminal), got {progress!r}")
    if chunks is None:
        chunks = int(profile.meta.get("chunks") or 8)
    options = CostOptions(chunks, checkpoint, optimizer, bandwidth, ties)
    kind = profile.meta.get("device_type")
    if devices is None and kind and isinstance(stages, int) and not isinstance(stages, bool) and stages > 0:
        devices = [f"{kind}:{s}" for s in range(stages)]  # one device of the profiled kind each
    specs = resolve_devices(stages, devices, memory_limit)
    costs = LayerCosts.from_profile(profile)
    n, k = len(costs), len(specs)
    check_stage_count(n, k)
    common: dict[str, Any] = dict(devices=specs, chunks=chunks, checkpoint=checkpoint,
                                  optimizer=optimizer, bandwidth=bandwidth, ties=ties)

    def plan(assignment: Sequence[int], name: str, solver: SolverInfo | None = None) -> Plan:
        split = [[profile.layers[v] for v in range(n) if assignment[v] == s] for s in range(k)]
        return Plan.from_stages(profile, split, method=name, solver=solver, **common)

    if method in ("uniform", "params", "blockpartition"):
        if method == "uniform":
            sizes = uniform_sizes(n, k)
        elif method == "params":
            sizes = params_sizes(_param_counts(costs), k)
        else:
            rec_n = recomputed_microbatches(checkpoint, chunks)
            sizes = blockpartition_sizes(list(layer_work(costs.fwd, costs.bwd, rec_n, chunks)), k)
        return plan(sizes_to_assignment(sizes), method)

    start = time.perf_counter()
    dp = solve_dp(costs, specs, options)
    dp_info = SolverInfo("optimal (over the topological order)" if method == "dp" or is_chain(profile)
                         else "optimal over the topological order", dp.bottleneck, None, None,
                         time.perf_counter() - start)
    if method == "dp" or (method == "auto" and is_chain(profile)):
        if is_chain(profile):
            dp_info = SolverInfo("optimal", dp.bottleneck, dp.bottleneck, 0.0, dp_info.seconds)
        return plan(dp.assignment, "dp", dp_info)
    line = ProgressLine(time_limit, progress)  # [Note: progress on a terminal]
    try:
        ilp = solve_ilp(costs, specs, options, warm_start=dp.assignment, time_limit=time_limit,
                        on_progress=line if line.enabled else None)
    finally:
        line.close()
    info = SolverInfo(ilp.status, ilp.objective, ilp.bound, ilp.gap,
                      dp_info.seconds + ilp.seconds)
    if method == "auto" and ilp.objective >= dp.bottleneck * (1 - 1e-9):
        return plan(dp.assignment, "dp", info)  # the ILP proved (or failed to beat) the DP
    return plan(ilp.assignment, "ilp", info)


def _param_counts(costs: LayerCosts) -> list[int]:
    counts = costs.params.copy()
    for members, nbytes in costs.tie_groups:
        counts[members[0]] += nbytes  # DeepSpeed counts a tied weight once, at its first use
    return [int(c) for c in np.asarray(counts)]

