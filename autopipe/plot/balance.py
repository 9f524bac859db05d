"""How balanced is a plan? Per-stage time and memory (``plot_balance``), plans side by side
(``compare_plans``).

Times are ms per micro-batch as in :class:`autopipe.Plan` (forward + backward + recompute +
transfer, see [Note: stage time] in autopipe.core.cost); the pipeline's pace is set by the tallest
bar, and the dashed line is the lower bound no split can beat (max of total work / K and the
largest layer). Memory is a stage's predicted peak (see [Note: stage memory]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from autopipe.core.plan import Plan
from autopipe.errors import PlotError
from autopipe.plot.style import (
    BOUND_COLOR,
    LIMIT_COLOR,
    PHASE_COLORS,
    byte_unit,
    check_plan,
    new_figure,
    stage_label,
)
from executor.spec import PHASES

__all__ = ["plot_balance", "compare_plans"]

_BREAKDOWN = {"forward": "fwd_ms", "backward": "bwd_ms", "recompute": "recompute_ms",
              "transfer": "transfer_ms"}


def plot_balance(plan: Plan, *, title: str | None = None) -> Figure:
    """Per-stage time and memory of ``plan``.

    Left: stacked bars of forward, backward, recompute and transfer time per micro-batch, with
    the lower bound as a dashed line and the bottleneck stage marked. Right: each stage's peak
    memory (parameter state and activations) against its device's limit, where one is set.
    Raises PlotError when ``plan`` is not a Plan.
    """
    plan = check_plan(plan, "plot_balance")
    k = plan.num_stages
    x = np.arange(k)
    fig = new_figure(max(8.0, 3.0 + 1.2 * k), 4.2)
    ax_t, ax_m = fig.subplots(1, 2)
    bottom = np.zeros(k)
    for phase in (p for p in PHASES if p in _BREAKDOWN):  # per micro-batch only; bwd_ms has the weights
        values = np.array([getattr(b, _BREAKDOWN[phase]) for b in plan.breakdown])
        ax_t.bar(x, values, 0.7, bottom=bottom, color=PHASE_COLORS[phase], label=phase)
        bottom += values
    ax_t.axhline(plan.lower_bound, ls="--", color=BOUND_COLOR, lw=1.2,
                 label=f"lower bound {plan.lower_bound:.3g} ms")
    worst = int(np.argmax(plan.stage_times))
    ax_t.annotate("bottleneck", (worst, plan.stage_times[worst]), xytext=(0, 3),
                  textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax_t.set_ylim(0, 1.4 * max(max(plan.stage_times), plan.lower_bound, 1e-9))
    _stage_axis(ax_t, plan)
    ax_t.set_ylabel("time per micro-batch (ms)")
    ax_t.set_title("time per stage")
    ax_t.legend(fontsize=8, loc="upper left", ncols=2)

    limits = [d.memory for d in plan.devices]
    largest = max([*plan.stage_memory, *[m for m in limits if m is not None], 1])
    unit, size = byte_unit(largest)
    params = np.array([b.param_bytes for b in plan.breakdown]) / size
    acts = np.array([b.activation_bytes for b in plan.breakdown]) / size
    ax_m.bar(x, params, 0.7, color="#55A868", label=f"parameters + grads + {plan.optimizer} state")
    ax_m.bar(x, acts, 0.7, bottom=params, color="#CCB974",
             label=f"activations (recompute={plan.recompute})")
    for s, limit in enumerate(limits):
        if limit is not None:
            ax_m.hlines(limit / size, s - 0.45, s + 0.45, colors=LIMIT_COLOR, lw=2,
                        label="device memory limit" if s == limits.index(limit) else None)
    _stage_axis(ax_m, plan)
    ax_m.set_ylabel(f"peak memory ({unit})")
    ax_m.set_title("peak memory per stage")
    ax_m.set_ylim(0, 1.4 * largest / size)
    ax_m.legend(fontsize=8, loc="upper left")

    above = 100 * (plan.bottleneck / plan.lower_bound - 1) if plan.lower_bound > 0 else 0.0
    fig.suptitle(title or (
        f"{plan.method}: {k} stages x {plan.chunks} micro-batches\nbottleneck "
        f"{plan.bottleneck:.3g} ms per micro-batch, {above:.1f}% above the lower bound"))
    return fig


def compare_plans(
    plans: Sequence[Plan] | Mapping[str, Plan], *, title: str | None = None
) -> Figure:
    """Plans side by side: bottleneck (with each plan's lower bound), bubble and peak memory.

    ``plans`` is a list (labelled by method; repeats get ``#2``, ``#3``) or a mapping
    ``{label: plan}``. Raises PlotError when it is empty or holds something other than Plans.
    """
    labels, items = _labelled(plans)
    n = len(items)
    x = np.arange(n)
    fig = new_figure(max(9.0, 3.0 + 1.4 * n), 4.0)
    ax_b, ax_u, ax_m = fig.subplots(1, 3)
    colors = [f"C{i % 10}" for i in range(n)]

    bars = ax_b.bar(x, [p.bottleneck for p in items], 0.7, color=colors)
    ax_b.bar_label(bars, fmt="%.3g", fontsize=8)
    ax_b.scatter(x, [p.lower_bound for p in items], marker="_", s=900, color=BOUND_COLOR,
                 linewidths=2, zorder=3, label="lower bound")
    ax_b.set_ylabel("bottleneck stage time per micro-batch (ms)")
    ax_b.set_title("bottleneck (lower is better)")
    ax_b.legend(fontsize=8, loc="upper right")

    bars = ax_u.bar(x, [100 * p.bubble_fraction for p in items], 0.7, color=colors)
    ax_u.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax_u.set_ylabel("bubble: idle share of the iteration (%)")
    ax_u.set_title("simulated GPipe bubble")

    limits = [min((d.memory for d in p.devices if d.memory is not None), default=None)
              for p in items]
    peak = [max(p.stage_memory) for p in items]
    unit, size = byte_unit(max([*peak, *[m for m in limits if m is not None], 1]))
    bars = ax_m.bar(x, np.array(peak) / size, 0.7, color=colors)
    ax_m.bar_label(bars, fmt="%.3g", fontsize=8)
    drawn = [(i, m) for i, m in enumerate(limits) if m is not None]
    ax_m.set_ylabel(f"largest stage peak memory ({unit})")
    ax_m.set_title("memory of the fullest stage" + ("" if drawn else " (no limit set)"))
    if drawn:
        ax_m.scatter([i for i, _ in drawn], [m / size for _, m in drawn], marker="_", s=900,
                     color=LIMIT_COLOR, linewidths=2, zorder=3, label="device memory limit")
        ax_m.legend(fontsize=8, loc="upper right")

    for ax in (ax_b, ax_u, ax_m):
        ax.set_xticks(x, labels, rotation=30 if n > 3 else 0, ha="right" if n > 3 else "center")
        ax.set_xlabel("plan")
        ax.margins(y=0.3)
    stages = sorted({p.num_stages for p in items})
    fig.suptitle(title or f"{n} plans compared ({'/'.join(map(str, stages))} stages)")
    return fig


def _labelled(plans: Sequence[Plan] | Mapping[str, Plan]) -> tuple[list[str], list[Plan]]:
    if isinstance(plans, Mapping):
        labels, items = [str(k) for k in plans], list(plans.values())
    elif isinstance(plans, Sequence) and not isinstance(plans, str):
        items = list(plans)
        seen: dict[str, int] = {}
        labels = []
        for p in items:
            method = getattr(p, "method", "?")
            seen[method] = seen.get(method, 0) + 1
            labels.append(method if seen[method] == 1 else f"{method} #{seen[method]}")
    else:
        raise PlotError(f"compare_plans needs a list or dict of Plans, got {type(plans).__name__}")
    if not items:
        raise PlotError("compare_plans got no plans; pass at least one, e.g. "
                        "[autopipe.partition(prof, stages=4, method=m) for m in ('dp', 'uniform')]")
    for label, p in zip(labels, items, strict=True):
        check_plan(p, f"compare_plans (entry {label!r})")
    return labels, items


def _stage_axis(ax: Axes, plan: Plan) -> None:
    ax.set_xticks(np.arange(plan.num_stages),
                  [stage_label(plan, s) for s in range(plan.num_stages)])
    ax.set_xlabel("pipeline stage")
