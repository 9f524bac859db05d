"""After the split: a stage that recomputes as a whole recomputes a few layers instead, if faster.

The search ([Note: automatic search] in search.py) gives each stage its fastest recompute mode
that fits. A stage that had to recompute (``always`` or ``except_last``) pays a whole second
forward for its recomputed micro-batches; often a few of its layers hold most of its saves for
little of its forward ([Note: recomputed layers] in autopipe/core/recomputed_layers.py). For
each such stage this pass takes mode ``never`` instead, with the segments of layers that bring
its peak under its device's memory at the least added time (``choose_segments``), asking again for more
where a segment's own recompute peak still overflows, and keeps the change where the stage gets
faster. The plan is then evaluated again and kept only if its
simulated iteration is faster and every device still fits (interleaved stages share one).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopipe.core.backward_memory import stage_walk
from autopipe.core.cost import (
    LayerCosts,
    StageCost,
    Terms,
    schedule_ranks,
    stage_costs,
)
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.recomputed_layers import choose_segments
from autopipe.solvers.stage_dp import budget_devices

__all__ = ["recompute_layers_where_faster"]


def _saved_to_fit(stage: StageCost, terms: Terms, limit: int) -> float:
    """The largest ``saved_bytes`` with which ``stage``'s state and activations fit ``limit``
    (-inf where even none fit)."""
    state = stage.param_bytes + stage.receive_bytes  # [Note: receive buffers] in stage_memory.py
    if state + stage.step_bytes > limit:  # [Note: the optimizer step's memory] in stage_memory.py
        return -np.inf
    (input_bytes, saved, held, input_saved), extras, loss = stage_walk(stage)
    room = limit - state - loss  # what its state (and its loss) leave for activations
    fixed = [room - a * input_bytes - c * held + d * input_saved - extras[e] for a, _, c, d, e in terms]
    bounds = [left / t[1] for left, t in zip(fixed, terms, strict=True) if t[1] > 0]
    if any(left < 0 for left, t in zip(fixed, terms, strict=True) if t[1] == 0):
        return -np.inf
    return min(bounds, default=np.inf) + stage.saved_bytes - saved  # the walk's saves less the received input's


def recompute_layers_where_faster(plan: Plan, profile: Profile) -> Plan:
    """``plan`` with layers recomputed alone instead of whole-stage recomputation where that is
    faster and fits; ``plan`` itself otherwise. ``profile`` is the one ``plan`` was made from."""
    modes = plan.stage_recompute
    if all(m == "never" for m in modes) or plan.recompute_layers:
        return plan
    costs = LayerCosts.from_profile(profile)
    where = {n: s for s, names in enumerate(plan.stages) for n in names}
    assignment = [where[n] for n in costs.names]
    options = plan.cost_options
    k = plan.num_stages
    trial = replace(options, recompute=("never",) * k, recompute_layers=())
    never = stage_costs(costs, assignment, plan.devices, trial)
    terms = trial.terms(k, schedule_ranks(options.schedule, plan.devices))
    budgets = budget_devices(plan.devices, plan.schedule)  # [Note: interleaved memory]: a share each
    new_modes, chosen, starts = list(modes), [], []
    for s, mode in enumerate(modes):
        limit = budgets[s].memory
        if mode == "never" or limit is None:
            continue
        fit = _saved_to_fit(never[s], terms[s], limit)
        if fit == -np.inf:
            continue
        need, held = never[s].saved_bytes - fit, max(t[1] for t in terms[s])
        mine = [i for i, st in enumerate(assignment) if st == s]
        for _ in range(4):  # a segment's recompute lives again at the peak: ask for that much more
            runs = choose_segments(costs, mine, need)  # apart, as chosen: [Note: recomputed layers]
            names, firsts = [costs.names[i] for r in runs for i in r], [costs.names[r[0]] for r in runs]
            stage = stage_costs(costs, assignment, plan.devices,
                                replace(trial, recompute_layers=tuple(names), segment_starts=tuple(firsts)))[s]
            if stage.memory_bytes <= limit or not names:
                break
            need += (stage.memory_bytes - limit) / max(held, 1)
        if stage.memory_bytes <= limit and stage.time_ms < plan.breakdown[s].time_ms:
            new_modes[s] = "never"
            chosen += names
            starts += firsts
    if not chosen and new_modes == modes:
        return plan
    candidate = Plan.from_stages(
        profile, plan.stages, devices=plan.devices, chunks=plan.chunks, recompute=new_modes,
        optimizer=plan.optimizer, bandwidth=plan.bandwidth, ties=plan.ties, method=plan.method,
        solver=plan.solver, schedule=plan.schedule, alternatives=plan.alternatives,
        data_parallel=plan.data_parallel, dp_mode=plan.dp_mode, recompute_layers=chosen, segment_starts=starts)
    fits = all(d.memory is None or candidate.device_memory.get(d.name, 0) <= d.memory for d in plan.devices)
    return candidate if fits and candidate.iteration_time < plan.iteration_time else plan
