"""A loaded Plan's fields checked, each bad one a TypeError that Plan.from_dict turns into one
PlanError line naming the file; the fields an older plan may lack, and the names it may use.

[Note: plan fields over time] ``autopipe-plan/1`` only ever gains optional fields, so every
older plan loads: ``recompute`` is one mode or, since per-stage recomputation, a list with one
mode per stage (a plan whose stages all share a mode stores the single mode, as before); plans
written before the word was ``recompute`` name it ``checkpoint``, in the plan and in each of its
``alternatives``, and load the same;
``schedule`` (default ``gpipe``), ``alternatives`` (what a search weighed) and
``device_memory`` were added with the automatic search; ``data_parallel`` (replicas of the
pipeline, default 1) and ``dp_mode`` (``ddp`` or ``fsdp``) with pipeline x data parallel;
``recompute_layers`` (default none) with [Note: recomputed layers]; ``runtime`` (``gpipe`` or
``distributed``, the runtime whose measured costs it was planned with; None: unrecorded) with
[Note: one profile, two runtimes] in autopipe/core/corrections.py; ``precision`` (default
``fp32``, the precision of the profile it was planned from: [Note: mixed precision memory] in
cost.py) with mixed precision; ``skipped_schedules`` (default none: the schedules a search could
not weigh, each with why) with the zero-bubble schedules; ``merge_backward`` (default
``unwaited``: which adjacent halves of a split backward run whole, [Note: adjacent I and W] in
executor/spec.py) with the planner's choice of it; ``estimated_from`` (default none: the device
sheet of an estimated profile, in words, [Note: estimated or measured] in estimated.py) with
estimated profiles; ``tensor_parallel`` (default 1: each stage on one rank; its costs per rank of
the TP group, [Note: tensor-parallel cost] in tensor_parallel.py) with tensor parallelism, in
the plan and in each alternative; ``segment_starts`` (default none: consecutive recomputed layers
form one segment, as before) with segments recomputed apart ([Note: recomputed layers] in
recomputed_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopipe.core.corrections import RUNTIMES
from executor.spec import DATA_PARALLEL_MODES, MERGE_RULES, PRECISIONS

if TYPE_CHECKING:
    from autopipe.core.plan import Plan

__all__ = ["OPTIONAL", "check_types", "renamed"]

OPTIONAL = ("solver", "largest_layer", "batch_size", "micro_batch_size", "schedule", "alternatives",
            "device_memory", "data_parallel", "dp_mode", "recompute_layers", "runtime", "precision",
            "skipped_schedules", "merge_backward", "estimated_from", "tensor_parallel",
            "segment_starts", "sequence_parallel")  # [Note: plan fields over time]: older plans lack them


def renamed(data: Any) -> Any:
    """A plan's (or an alternative's) fields as they are named now: ``checkpoint`` -> ``recompute``
    ([Note: plan fields over time])."""
    if isinstance(data, dict) and "checkpoint" in data and "recompute" not in data:
        return {("recompute" if k == "checkpoint" else k): v for k, v in data.items()}
    return data


def check_types(plan: Plan) -> None:
    """TypeError naming the first field of ``plan`` that is malformed."""
    k = len(plan.stages)
    if not (isinstance(plan.stages, list) and all(
            isinstance(s, list) and s and all(isinstance(n, str) for n in s) for s in plan.stages)):
        raise TypeError("'stages' must be a list of non-empty lists of layer names")
    for name in ("devices", "stage_times", "stage_memory", "peak_memory", "breakdown"):
        value = getattr(plan, name)
        if not isinstance(value, list) or len(value) != k:
            raise TypeError(f"{name!r} must be a list with one entry per stage ({k})")
    numbers = [*plan.stage_times, *plan.stage_memory, *plan.peak_memory, plan.bottleneck,
               plan.iteration_time, plan.lower_bound, plan.bubble_fraction]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers):
        raise TypeError("times and memory must be numbers")
    if not isinstance(plan.chunks, int) or plan.chunks < 1:
        raise TypeError(f"'chunks' must be an integer >= 1, got {plan.chunks!r}")
    for name in ("batch_size", "micro_batch_size"):
        value = getattr(plan, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TypeError(f"{name!r} must be an integer >= 1 or null, got {value!r}")
    if not isinstance(plan.recompute, str | list):
        raise TypeError(f"'recompute' must be a mode or a list of modes, got {plan.recompute!r}")
    if plan.merge_backward not in MERGE_RULES:
        raise TypeError(f"'merge_backward' must be one of {list(MERGE_RULES)}, got {plan.merge_backward!r}")
    if not isinstance(plan.data_parallel, int) or isinstance(plan.data_parallel, bool) or plan.data_parallel < 1:
        raise TypeError(f"'data_parallel' must be an integer >= 1, got {plan.data_parallel!r}")
    if not isinstance(plan.tensor_parallel, int) or isinstance(plan.tensor_parallel, bool) or plan.tensor_parallel < 1:
        raise TypeError(f"'tensor_parallel' must be an integer >= 1, got {plan.tensor_parallel!r}")
    if not isinstance(plan.sequence_parallel, bool):
        raise TypeError(f"'sequence_parallel' must be true or false, got {plan.sequence_parallel!r}")
    if plan.sequence_parallel and plan.tensor_parallel < 2:
        raise TypeError("'sequence_parallel' splits by sequence over a TP group: it needs tensor_parallel >= 2")
    if plan.dp_mode not in DATA_PARALLEL_MODES:
        raise TypeError(f"'dp_mode' must be one of {list(DATA_PARALLEL_MODES)}, got {plan.dp_mode!r}")
    plan.cost_options.modes(k)  # builds CostOptions: the fields above checked first, by name
    if not all(isinstance(v, int) for v in plan.device_memory.values()):
        raise TypeError("'device_memory' must map device names to bytes")
    if plan.precision not in PRECISIONS:
        raise TypeError(f"'precision' must be one of {list(PRECISIONS)}, got {plan.precision!r}")
    if not isinstance(plan.skipped_schedules, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in plan.skipped_schedules.items()):
        raise TypeError("'skipped_schedules' must map schedule names to reasons")
    if plan.estimated_from is not None and not isinstance(plan.estimated_from, str):
        raise TypeError(f"'estimated_from' must be a device sheet's name or null, got {plan.estimated_from!r}")
    if plan.runtime not in (None, *RUNTIMES):
        raise TypeError(f"'runtime' must be one of {list(RUNTIMES)} or null, got {plan.runtime!r}")
    where = {n: s for s, names in enumerate(plan.stages) for n in names}
    modes = plan.stage_recompute
    if not isinstance(plan.recompute_layers, list) or not all(
            isinstance(n, str) and modes[where.get(n, 0)] == "never" and n in where for n in plan.recompute_layers):
        raise TypeError("'recompute_layers' must list layers of stages whose recompute is 'never'")
    chosen = set(plan.recompute_layers)
    if not isinstance(plan.segment_starts, list) or not all(isinstance(n, str) and n in chosen
                                                            for n in plan.segment_starts):
        raise TypeError("'segment_starts' must list layers of 'recompute_layers' (each the first of its segment)")
