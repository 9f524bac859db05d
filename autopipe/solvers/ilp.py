"""Optimal partition of a layer DAG with PuLP (CBC): any precedence-respecting split, not only
contiguous runs of one topological order.

[Note: monotone ILP] Stage membership is encoded monotonically: binary ``y[v, s] = 1`` iff
``stage(v) <= s`` (for s < K-1), so ``y[v, s] <= y[v, s+1]``, precedence of an edge u -> v is
``y[v, s] <= y[u, s]`` and membership is ``x[v, s] = y[v, s] - y[v, s-1]``. A value u crosses
cut s iff ``y[u, s] = 1`` and some consumer has ``y[v, s] = 0``: continuous
``z[u, s] >= y[u, s] - y[v, s]`` (minimisation drives it to 0/1), which charges pass-through
values at every cut they cross ([Note: transfer cost] in autopipe.core.cost). This is far tighter for
CBC than one-hot assignment with ``stage(u) <= stage(v)`` written through stage indices.

The model minimises T subject to ``T >= time(s)`` and ``memory(s) <= limit(s)`` for every stage
(one memory constraint per activation term of the stage's schedule and recompute mode: the
peak is a maximum of linear terms, [Note: stage memory]; which layer comes first in a stage is
not linear in y, so a recomputed micro-batch's input and its first layer's save of it are held
apart here, on the safe side of [Note: an input kept once]; a stage's largest working set and its
first backward's maximum over its layers are variables bounded below by each layer's term,
[Note: the backward's memory]),
with autopipe.core.cost's formulas applied to PuLP expressions, tie groups shared (a member anywhere charges the group's
bytes to that stage) or colocated (members' y rows equal), and non-empty stages. CBC is
warm-started from the exact DP split, so it never returns worse than the DP. CBC runs through
autopipe.solvers.cbc_log, which reads its log for the bound and, live, for progress.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pulp

from autopipe.core.backward_memory import gather_terms, gathered_bytes, lazy_grad_bytes
from autopipe.core.cost import (
    OPTIMIZER_FACTOR,
    STEP_TEMPORARIES,
    DeviceSpec,
    LayerCosts,
    activation_bytes,
    backward_extras,
    cast_cache_bytes,
    kept_bytes,
    layer_work,
    loss_bytes,
    loss_grad_bytes,
    lower_bound,
    schedule_ranks,
    stage_costs,
    stage_fixed_ms,
    stage_time,
    state_bytes,
    step_bytes,
    weight_held_bytes,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.recomputed_layers import recomputed_outputs
from autopipe.core.stage_memory import Extras, receive_bytes
from autopipe.errors import PartitionError
from autopipe.solvers.cbc_log import SolverProgress, run_cbc
from executor.spec import ZERO_BUBBLE_SCHEDULES

__all__ = ["GAP", "ILPResult", "solve_ilp"]

GAP = 0.005  # relative: CBC stops once its incumbent is proven within this of optimal


@dataclass(frozen=True)
class ILPResult:
    assignment: list[int]
    objective: float  # ms, the bottleneck of ``assignment``
    bound: float  # ms, CBC's best lower bound
    gap: float  # (objective - bound) / objective
    status: str  # "optimal", "time_limit" or "feasible"
    seconds: float


def _backward_extras(prob: pulp.LpProblem, costs: LayerCosts, options: CostOptions,
                     params: pulp.LpAffineExpression, s: int, last: int, x: Callable[[int, int], Any],
                     sending: Any = 0) -> Extras:
    """Stage s's backward extras as PuLP expressions ([Note: the backward's memory] in
    stage_memory.py): its largest working set and its first backward's maximum over its layers
    in index order (``first_backward_bytes``), each a variable bounded below by every layer's
    term; ``r[v]``, the lazy gradients less the saves of the stage's layers after v; ``sending``,
    its input gradient in flight."""
    n, factor = len(costs), OPTIMIZER_FACTOR[options.optimizer]
    lazy = lazy_grad_bytes(params, factor, options.data_parallel, options.dp_mode, options.schedule)
    grads = costs.params * (lazy_grad_bytes(1, factor, options.data_parallel, options.dp_mode, options.schedule) > 0)
    assert costs.working is not None
    net = [float(g) - float(b) for g, b in zip(grads, costs.saved, strict=True)]
    working, first = pulp.LpVariable(f"working_{s}", lowBound=0), pulp.LpVariable(f"first_{s}")
    grads = loss_grad_bytes(costs, options.chunks) if s == last else 0
    beside = pulp.LpVariable(f"beside_{s}", lowBound=0) if grads else working  # working_beside_loss's
    if grads:
        prob += beside >= working + costs.returned - grads
    after: Any = 0  # r[v] for v = n - 1; a variable each, so no constraint holds a sum over layers
    for v in range(n - 1, -1, -1):
        prob += working >= float(costs.working[v]) * x(v, s)
        prob += first >= after + float(costs.working[v]) * x(v, s)
        done = pulp.LpVariable(f"after_{s}_{v}")
        prob += done == after + net[v] * x(v, s)
        prob += first >= done  # once v is done
        after = done
    return backward_extras(lazy, first, beside, sending)


def solve_ilp(
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    options: CostOptions,
    *,
    warm_start: Sequence[int] | None = None,
    time_limit: float = 60.0,
    gap: float = GAP,
    threads: int | None = None,
    on_progress: Callable[[SolverProgress], None] | None = None,
    bound: float | None = None,
) -> ILPResult:
    """Solve the partition ILP; ``warm_start`` is a feasible assignment (e.g. the DP's), ``bound``
    a known lower bound on every split's bottleneck (autopipe.solvers.dag_bound), a constraint.

    ``on_progress`` is called with the solver's incumbent, bound and gap while CBC works
    (autopipe.solvers.cbc_log.run_cbc), from a reader thread.
    """
    with warnings.catch_warnings():  # PuLP 3 warns about its own 4.0 API changes
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve(costs, devices, options, warm_start, time_limit, gap, threads, on_progress,
                      bound)


def _solve(
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    options: CostOptions,
    warm_start: Sequence[int] | None,
    time_limit: float,
    gap: float,
    threads: int | None,
    on_progress: Callable[[SolverProgress], None] | None,
    known_bound: float | None,
) -> ILPResult:
    start_time = time.perf_counter()
    n, k = len(costs), len(devices)
    if k == 1:
        (c,) = stage_costs(costs, [0] * n, devices, options)
        return ILPResult([0] * n, c.time_ms, c.time_ms, 0.0, "optimal", 0.0)
    m = options.chunks
    ranks = costs.runtime == "distributed"
    # each layer's share of the model's outputs ([Note: receive buffers] in stage_memory.py)
    returned = np.diff(costs.returned_before) if costs.returned_before is not None else np.zeros(n)
    recomputed = options.recomputed(k)
    terms = options.terms(k, schedule_ranks(options.schedule, devices))
    cuts = range(k - 1)
    ratio = costs.recompute_ratio
    work_array = layer_work(costs.fwd, costs.bwd, min(recomputed), m, ratio)
    stage_work = [layer_work(costs.fwd, costs.bwd, r, m, ratio) for r in recomputed]

    prob = pulp.LpProblem("autopipe_partition", pulp.LpMinimize)
    y = [[pulp.LpVariable(f"y_{v}_{s}", cat="Binary") for s in cuts] for v in range(n)]
    senders = [u for u in range(n) if costs.consumers[u] and costs.value_bytes[u] > 0]
    z = {(u, s): pulp.LpVariable(f"z_{u}_{s}", 0, 1) for u in senders for s in cuts}
    # the value crosses cut s to a consumer that saves it too: [Note: saved once]
    zr = {(u, s): pulp.LpVariable(f"zr_{u}_{s}", 0, 1) for u in senders if costs.resaved[u] for s in cuts}
    t = pulp.LpVariable("T", 0)
    prob += t

    def yv(v: int, s: int) -> pulp.LpAffineExpression | int:
        return 0 if s < 0 else (1 if s >= k - 1 else y[v][s])

    def x(v: int, s: int) -> pulp.LpAffineExpression:
        return yv(v, s) - yv(v, s - 1)  # type: ignore[no-any-return]

    for v in range(n):
        for s in range(k - 2):
            prob += y[v][s] <= y[v][s + 1]
    for u in range(n):
        for v in costs.consumers[u]:
            for s in cuts:
                prob += y[v][s] <= y[u][s]
                if (u, s) in z:
                    prob += z[u, s] >= y[u][s] - y[v][s]
                if (u, s) in zr and v in costs.savers[u]:
                    prob += zr[u, s] >= y[u][s] - y[v][s]
    for members in costs.kept_together(options.ties):
        for v in members[1:]:
            for s in cuts:
                prob += y[v][s] == y[members[0]][s]
    h = {}
    if options.ties == "share":
        for g, (members, _) in enumerate(costs.tie_groups):
            for s in range(k):
                h[g, s] = pulp.LpVariable(f"h_{g}_{s}", 0, 1)
                for v in members:
                    prob += h[g, s] >= x(v, s)

    def crossing(s: int, per_value: npt.NDArray[Any] = costs.value_bytes,
                 over: dict[tuple[int, int], Any] = z) -> pulp.LpAffineExpression:
        if s < 0 or s >= k - 1:
            return pulp.lpSum([])
        return pulp.lpSum(int(per_value[u]) * over[u, s] for u in senders if per_value[u])

    call = costs.call_ms(options.schedule)
    grads = costs.weight_grad if options.schedule in ZERO_BUBBLE_SCHEDULES else None
    lower = max(lower_bound(work_array, [d.speed for d in devices], call), known_bound or 0.0)
    prob += t >= lower

    def total(values: Sequence[float] | npt.NDArray[Any], s: int) -> pulp.LpAffineExpression:
        return pulp.lpSum(float(values[v]) * x(v, s) for v in range(n) if values[v])

    for s, dev in enumerate(devices):
        prob += pulp.lpSum(x(v, s) for v in range(n)) >= 1
        prob += t >= stage_time(total(stage_work[s], s), dev.speed, crossing(s - 1), crossing(s),
                                options.ms_per_byte,
                                stage_fixed_ms(call, costs.recompute_call_ms, recomputed[s], m),
                                costs.comm_latency_ms, costs.comm_receive_share)
        if dev.memory is not None:
            if options.ties == "share":
                tied = pulp.lpSum(nbytes * h[g, s] for g, (_, nbytes) in enumerate(costs.tie_groups))
            else:
                tied = pulp.lpSum(nbytes * x(members[0], s) for members, nbytes in costs.tie_groups)
            params = total(costs.params, s) + tied
            state = state_bytes(params, total(costs.buffers, s), options.optimizer,
                                options.data_parallel, options.dp_mode) + cast_cache_bytes(
                params, costs.precision, recomputed[s])  # [Note: mixed precision memory]
            if ranks:  # [Note: receive buffers] in stage_memory.py (the first layer's save of the input
                # is still charged in the saves: on the safe side)
                state = state + receive_bytes(costs, crossing(s - 1), crossing(s), m)
            held = 0 if grads is None else weight_held_bytes(  # [Note: split backward time] in cost.py
                total(grads, s), crossing(s), s == 0, s == k - 1, ranks)
            if options.optimizer in STEP_TEMPORARIES:  # [Note: the optimizer step's memory] in stage_memory.py
                if costs.one_at_a_time and costs.layer_params is not None:  # each layer's tensors must fit
                    for v in range(n):
                        if costs.layer_params[v]:
                            step = step_bytes(params, int(costs.layer_params[v]) * x(v, s), options.optimizer,
                                              True, options.data_parallel, options.dp_mode)
                            prob += state + step <= dev.memory
                else:
                    prob += state + step_bytes(params, 0, options.optimizer, False, options.data_parallel,
                                               options.dp_mode) <= dev.memory
            extras = None if costs.working is None else _backward_extras(prob, costs, options, params, s, k - 1, x,
                                                                         crossing(s - 1) if ranks else 0)
            walked_input = 0 if ranks else crossing(s - 1)  # on ranks, in its buffer
            received = costs.returned - total(returned, s)  # the model's outputs made before the stage
            for term in terms[s]:  # the peak is the largest term: each must fit
                last = s == k - 1  # [Note: the loss's memory]: the last stage's a constant, the others' kept output
                loss = loss_bytes(0, 0, (term,), 0, 0, kept_bytes(costs, crossing(s), last, received),
                                  loss_grad_bytes(costs, m) if last else 0) + recomputed_outputs(
                    crossing(s), last, recomputed[s])  # [Note: recomputed layers]
                prob += state + activation_bytes(
                    walked_input, total(costs.saved, s) + crossing(s - 1, costs.resaved, zr), (term,),
                    held, extras=extras) + loss <= dev.memory
            gathered = gathered_bytes(costs, m, s == k - 1) if extras is not None else 0
            for term in gather_terms(terms[s]) if gathered else ():  # executor.GPipe's gathered outputs
                kept = loss_bytes(0, 0, (term,), 0, 0, costs.returned, 0)
                prob += state + activation_bytes(
                    crossing(s - 1), total(costs.saved, s) + crossing(s - 1, costs.resaved, zr), (term,),
                    held, extras=extras) + kept + gathered <= dev.memory

    warm_value = math.inf
    if warm_start is not None:
        warm_value = _set_warm_start(costs, devices, options, warm_start, y, z, h, t)
    log = run_cbc(prob, time_limit=time_limit, gap=gap, warm_start=warm_start is not None,
                  threads=threads, on_progress=on_progress)
    seconds = time.perf_counter() - start_time
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        raise PartitionError(
            f"the ILP has no split into {k} stages within the memory limits; "
            f"try recompute='always', more stages or devices with more memory"
        )
    values = [[pulp.value(var) for var in row] for row in y]
    if status != "Optimal" or any(v is None for row in values for v in row):
        if warm_start is None:
            raise PartitionError(f"CBC failed ({log.error}); partition with method='exact'" if log.error else
                                 f"the ILP found no split in time_limit={time_limit}s; raise time_limit")
        if log.error:
            warnings.warn(f"the ILP's solver CBC failed ({log.error}); the plan keeps the split it "
                          "started from (method='exact' does not run CBC)", RuntimeWarning, stacklevel=3)
        assignment = list(warm_start)
    else:
        assignment = [sum(1 for val in row if (val or 0) < 0.5) for row in values]
    objective = max(c.time_ms for c in stage_costs(costs, assignment, devices, options))
    if objective > warm_value:  # never worse than the warm start
        assignment, objective = list(warm_start or assignment), warm_value
    bound = max(min(objective, log.bound if log.bound is not None else -math.inf), lower)
    rel_gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    stopped = log.stopped_on_time
    label = "optimal" if rel_gap <= gap + 1e-9 and not stopped else ("time_limit" if stopped else "feasible")
    return ILPResult(assignment, objective, bound, rel_gap, label, seconds)


def _set_warm_start(
    costs: LayerCosts,
    devices: Sequence[DeviceSpec],
    options: CostOptions,
    assignment: Sequence[int],
    y: list[list[pulp.LpVariable]],
    z: dict[tuple[int, int], pulp.LpVariable],
    h: dict[tuple[int, int], pulp.LpVariable],
    t: pulp.LpVariable,
) -> float:
    for v, row in enumerate(y):
        for s, var in enumerate(row):
            var.setInitialValue(1 if assignment[v] <= s else 0)
    for (u, s), var in z.items():
        reach = max(assignment[c] for c in costs.consumers[u])
        var.setInitialValue(1 if assignment[u] <= s < reach else 0)
    for (g, s), var in h.items():
        members, _ = costs.tie_groups[g]
        var.setInitialValue(1 if any(assignment[v] == s for v in members) else 0)
    value = max(c.time_ms for c in stage_costs(costs, list(assignment), devices, options))
    t.setInitialValue(value)
    return value

