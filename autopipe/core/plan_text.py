"""A Plan in words: the per-stage table, what limits it, and the alternatives the search weighed.

``Plan.table()`` and ``Plan.explain()`` call these; nothing here computes a cost that
autopipe.core.cost does not (the memory a stage would need without recomputation is
``cost.activation_bytes`` with the ``never`` terms of its schedule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from autopipe.core.backward_memory import stage_walk
from autopipe.core.cost import activation_bytes, schedule_ranks, stage_terms
from autopipe.core.units import format_bytes
from executor.spec import ZERO_BUBBLE_SCHEDULES

if TYPE_CHECKING:
    from autopipe.core.plan import Alternative, Plan

__all__ = ["explain", "table", "alternatives_table", "recompute_text", "memory_forced"]


def recompute_text(recompute: str | list[str]) -> str:
    """``except_last``, or a per-stage list run-length coded: ``always x2, never x2``."""
    if isinstance(recompute, str):
        return recompute
    runs: list[list[object]] = []
    for mode in recompute:
        if runs and runs[-1][0] == mode:
            runs[-1][1] = int(str(runs[-1][1])) + 1
        else:
            runs.append([mode, 1])
    return ", ".join(f"{m} x{n}" if n != 1 else str(m) for m, n in runs)


def memory_forced(plan: Plan) -> list[tuple[int, int]]:
    """Stages that recompute because they would not fit without it: (stage, bytes needed with
    ``never``), for stages whose device has a memory limit."""
    k = plan.num_stages
    ranks = schedule_ranks(plan.schedule, plan.devices)
    out = []
    for s, mode in enumerate(plan.stage_recompute):
        dev, b = plan.devices[s], plan.breakdown[s]
        if mode == "never" or dev.memory is None:
            continue
        never = stage_terms(plan.schedule, s, k, plan.chunks, 0, ranks, plan.merge_backward)
        walk, extras, loss = stage_walk(b)  # [Note: receive buffers] in stage_memory.py
        need = b.param_bytes + b.receive_bytes + max(
            loss + int(activation_bytes(walk[0], walk[1], never, walk[2], extras=extras)), b.step_bytes)
        share = dev.memory // (k // ranks) if ranks else dev.memory  # [Note: interleaved memory]
        if need > share:
            out.append((s, need))
    return out


def _limit(plan: Plan, s: int) -> str:
    b = plan.breakdown[s]
    over_stage = [i for i, (mem, d) in enumerate(zip(plan.stage_memory, plan.devices, strict=True))
                  if d.memory is not None and mem > d.memory]
    if over_stage:
        i = over_stage[0]
        return (f"memory: stage {i} needs {format_bytes(plan.stage_memory[i])} but "
                f"{plan.devices[i].name} has {format_bytes(plan.devices[i].memory)}")
    over = [name for name, mem in plan.device_memory.items()
            if (limit := _memory_of(plan, name)) is not None and mem > limit]
    if over:  # stages that share a device (an interleaved rank's) together
        name = over[0]
        return (f"memory: {name} needs {format_bytes(plan.device_memory[name])} for its stages "
                f"together but has {format_bytes(_memory_of(plan, name))}")
    forced = memory_forced(plan)
    if forced:
        i, need = forced[0]
        more = f" (and {len(forced) - 1} more stage(s))" if len(forced) > 1 else ""
        return (f"memory: stage {i} recomputes ({plan.stage_recompute[i]}) because without it "
                f"it needs {format_bytes(need)} and {plan.devices[i].name} has "
                f"{format_bytes(plan.devices[i].memory)}{more}; stages that fit run without "
                f"recomputation")
    if plan.bottleneck <= 1.005 * plan.lower_bound:
        return "time: the split is balanced; add stages or faster devices"
    if plan.largest_layer[1] / max(d.speed for d in plan.devices) >= 0.9 * plan.bottleneck:
        return (f"time: the big layer {plan.largest_layer[0]!r}; no split can go below it; "
                f"split that layer or use fewer stages")
    if b.transfer_ms > 0.1 * b.time_ms:
        return (f"time: transfers, {b.transfer_ms:.3f} ms ({100 * b.transfer_ms / b.time_ms:.0f}%) "
                f"of stage {s} is sending activations and gradients; raise bandwidth or cut at "
                f"thinner activations")
    tight = [i for i, (mem, d) in enumerate(zip(plan.stage_memory, plan.devices, strict=True))
             if d.memory is not None and mem > 0.9 * d.memory]
    if tight:
        i = tight[0]
        return (f"memory: stage {i} uses {100 * plan.stage_memory[i] / (plan.devices[i].memory or 1):.0f}% "
                f"of its device, which keeps layers off it")
    return "time: layer granularity; whole layers cannot be balanced more evenly"


def _collectives(plan: Plan) -> str:
    """The data-parallel collectives in one sentence ([Note: pipeline x data parallel])."""
    d, b = plan.data_parallel, plan.breakdown
    s = max(range(plan.num_stages), key=lambda i: b[i].grad_sync_ms)
    sync = "reduce-scatter" if plan.dp_mode == "fsdp" else "all-reduce"
    gather = (f", after an all-gather of up to {max(c.param_gather_ms for c in b):.3f} ms before "
              f"its first forward" if plan.dp_mode == "fsdp" else "")
    batch = (f"{plan.batch_size // d} of the {plan.batch_size} rows of the global batch"
             if plan.batch_size else "its own batch")
    return (f"Each replica trains {batch}; a stage's gradient {sync} starts after its last "
            f"backward and overlaps the other stages' backwards{gather}: up to "
            f"{b[s].grad_sync_ms:.3f} ms (stage {s}).")


def _mesh(plan: Plan) -> str:
    """The mesh chosen, PP x TP x DP ([Note: the mesh] in solvers/tensor_parallel_search.py)."""
    t, d, k = plan.tensor_parallel, plan.data_parallel, plan.num_stages
    ranks = len({dev.name for dev in plan.devices})
    split = (f"each stage's layers split over {t} ranks of one host, its time, weights and split "
             f"activations per rank, its all-reduces inside every stage's time" if t > 1 else
             "no tensor parallelism: it was slower or did not fit")
    if t > 1 and plan.sequence_parallel:  # [Note: sequence parallelism]
        split += ("; the layers between its groups (norms, residual adds) split by tokens too, "
                  "the all-reduces a reduce-scatter and an all-gather each")
    return f"Mesh: PP {ranks} x TP {t} x DP {d} = {ranks * t * d} devices ({k} stages), {split}."


def _memory_of(plan: Plan, name: str) -> int | None:
    limits = [d.memory for d in plan.devices if d.name == name]
    return limits[0] if limits else None


def explain(plan: Plan) -> str:
    """What was chosen, what limits it (memory or time), and the next best alternatives."""
    k = plan.num_stages
    s = int(np.argmax(plan.stage_times))
    total = sum(plan.stage_times)
    rows = f" of {plan.micro_batch_size} rows" if plan.micro_batch_size else ""
    d = plan.data_parallel
    replicas = f"{d} replicas ({plan.dp_mode}) x " if d > 1 else ""
    parts = [
        f"{replicas}{k} stage(s) split by method {plan.method!r}, schedule {plan.schedule}, {plan.chunks} "
        f"micro-batches{rows}, recomputation {recompute_text(plan.recompute)}: simulated "
        f"iteration {plan.iteration_time:.3f} ms ({100 * plan.bubble_fraction:.0f}% bubble).",
    ]
    if d > 1:
        parts.append(_collectives(plan))
    if plan.tensor_parallel > 1 or any(a.tensor_parallel > 1 for a in plan.alternatives):
        parts.append(_mesh(plan))
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:  # [Note: adjacent I and W] in executor/spec.py
        where = ("on every stage" if plan.merge_backward == "adjacent"
                 else "where no other rank waits for the input gradient")
        parts.append(f"A split backward runs whole where its weight half would follow at once, {where} "
                     f"(merge_backward {plan.merge_backward!r}).")
    if plan.lower_bound > 0:
        big_name, big_ms = plan.largest_layer
        parts.append(
            f"The bottleneck is stage {s} ({plan.spans()[s]}, {len(plan.stages[s])} layers on "
            f"{plan.devices[s].name}) at {plan.bottleneck:.3f} ms per micro-batch, "
            f"{100 * plan.stage_times[s] / total:.0f}% of the summed stage time; the lower bound "
            f"max(T/K, largest layer) is {plan.lower_bound:.3f} ms (largest layer {big_name!r}: "
            f"{big_ms:.3f} ms), so the plan is "
            f"{max(0.0, 100 * (plan.bottleneck / plan.lower_bound - 1)):.1f}% above it.")
    else:
        parts.append("Every layer costs 0 ms.")
    parts.append(f"Limited by {_limit(plan, s)}.")
    build = plan.build_memory
    if any(build.values()):  # [Note: the build's memory] in stage_memory.py
        name = max(build, key=build.__getitem__)
        parts.append(f"Building it from a model on the meta device holds at most {format_bytes(build[name])} "
                     f"({name}: its stages' parameters and buffers).")
    if plan.recompute_layers:
        runs = sum(b.recompute_segments for b in plan.breakdown)
        apart = f", {runs} segments recomputed alone" if runs else ""
        parts.append(f"{len(plan.recompute_layers)} layer(s) recompute alone instead of whole stages{apart} "
                     f"(those that save most for their forward time, or every repeated block where a stage "
                     f"fits no other way): " + "; ".join(_recomputed_lines(plan)) + ".")
    if plan.solver.gap is not None:
        parts.append(f"Solver status {plan.solver.status}, gap {100 * plan.solver.gap:.2f}%.")
    weighed = _schedules_weighed(plan)
    if weighed:
        parts.append(weighed)
    text = " ".join(parts)
    if plan.estimated_from is not None:  # [Note: estimated or measured]: said first
        text = (f"ESTIMATED, not measured: every time and byte below was counted on device sheet "
                f"{plan.estimated_from} ([Note: roofline]), no layer was timed.\n{text}")
    if plan.alternatives:
        text += "\n\nNext best alternatives searched:\n" + alternatives_table(plan)
    return text


def _schedules_weighed(plan: Plan) -> str:
    """The schedules a search weighed, each at the best of its configurations it simulated (the
    others were bounded no faster than the chosen plan: [Note: automatic search]), and those it
    left out with why; "" for a plan of one given configuration."""
    if not plan.alternatives and not plan.skipped_schedules:
        return ""
    best: dict[str, float] = {plan.schedule: plan.iteration_time}
    for a in plan.alternatives:
        best[a.schedule] = min(best.get(a.schedule, a.iteration_time), a.iteration_time)
    text = "Schedules weighed (each at its best simulated; the rest bounded no faster): " + ", ".join(f"{name} {t:.3f} ms" for name, t in
                                               sorted(best.items(), key=lambda x: x[1])) + "."
    if plan.skipped_schedules:
        text += " Not weighed: " + "; ".join(f"{name} ({why})" for name, why in plan.skipped_schedules.items()) + "."
    return text


def alternatives_table(plan: Plan) -> str:
    """A small markdown table: the chosen plan, then the alternatives the search weighed."""
    # a replicas column once any row has replicas ([Note: pipeline x data parallel]), a TP column
    # once any row has TP ([Note: the mesh])
    wide = plan.data_parallel > 1 or any(a.data_parallel > 1 for a in plan.alternatives)
    tp = plan.tensor_parallel > 1 or any(a.tensor_parallel > 1 for a in plan.alternatives)
    head = (("| TP " if tp else "") + ("| replicas " if wide else "") + "| stages | chunks | schedule | "
            "recomputation | iteration ms | vs chosen | bottleneck ms | peak memory | note |\n"
            + ("|---:" if tp else "") + ("|---:" if wide else "") + "|---:|---:|---|---|---:|---:|---:|---:|---|")
    chosen = plan.highest_memory
    rows = [_row(plan.num_stages, plan.chunks, plan.schedule, plan.recompute, plan.iteration_time,
                 plan.iteration_time, plan.bottleneck, chosen, "chosen",
                 (plan.tensor_parallel if tp else None, plan.data_parallel if wide else None))]
    rows += [_row(a.stages, a.chunks, a.schedule, a.recompute, a.iteration_time,
                  plan.iteration_time, a.bottleneck, a.memory, a.note,
                  (a.tensor_parallel if tp else None, a.data_parallel if wide else None))
             for a in plan.alternatives]
    return "\n".join([head, *rows])


def _row(k: int, m: int, schedule: str, recompute: str | list[str], t: float, best: float,
         bottleneck: float, memory: int, note: str, mesh: tuple[int | None, int | None]) -> str:
    versus = "" if t == best else f"{100 * (t / best - 1):+.1f}%"
    first = "".join(f"| {x} " for x in mesh if x is not None)
    return (f"{first}| {k} | {m} | {schedule} | {recompute_text(recompute)} | {t:.3f} | {versus} | "
            f"{bottleneck:.3f} | {format_bytes(memory)} | {note} |")


def table(plan: Plan) -> str:
    """A per-stage table: layers, time, memory, recomputation and share of the summed time."""
    total = sum(plan.stage_times) or 1.0
    spans = plan.spans()
    wide = max(len("first .. last"), *(len(x) for x in spans))
    dev = max(len("device"), *(len(d.name) for d in plan.devices))
    rows = [f"{'stage':>5}  {'device':<{dev}} {'layers':>6}  {'first .. last':<{wide}} {'time ms':>9} "
            f"{'fwd':>8} {'bwd':>8} {'recomp':>8} {'xfer':>8} {'memory':>10}  {'share':>5}  {'recompute':<11}"]
    for s, names in enumerate(plan.stages):
        b = plan.breakdown[s]
        rows.append(
            f"{s:>5}  {plan.devices[s].name:<{dev}} {len(names):>6}  {spans[s]:<{wide}} "
            f"{plan.stage_times[s]:>9.3f} {b.fwd_ms:>8.3f} {b.bwd_ms:>8.3f} {b.recompute_ms:>8.3f} "
            f"{b.transfer_ms:>8.3f} {format_bytes(plan.stage_memory[s]):>10}  "
            f"{100 * plan.stage_times[s] / total:>4.0f}%  {plan.stage_recompute[s]:<11}"
        )
    return "\n".join(rows + _recomputed_lines(plan))


def _recomputed_lines(plan: Plan) -> list[str]:
    """Per stage, the layers it recomputes alone ([Note: recomputed layers]), a few named."""
    chosen = set(plan.recompute_layers)
    lines = []
    for s, names in enumerate(plan.stages):
        mine = [n for n in names if n in chosen]
        if mine:
            shown = ", ".join(mine[:4]) + (f" and {len(mine) - 4} more" if len(mine) > 4 else "")
            runs = plan.breakdown[s].recompute_segments
            apart = f" in {runs} segment(s)" if runs else ""
            lines.append(f"stage {s} recomputes {len(mine)} layer(s) alone{apart} in its backward: {shown}")
    return lines


def describe(a: Alternative) -> str:
    """One alternative in a few words (for progress and error messages)."""
    replicas = f"{a.data_parallel} replicas x " if a.data_parallel > 1 else ""
    replicas += f"TP {a.tensor_parallel} x " if a.tensor_parallel > 1 else ""
    return (f"{replicas}{a.stages} stages, {a.chunks} micro-batches, {a.schedule}, "
            f"{recompute_text(a.recompute)}: {a.iteration_time:.3f} ms")
