"""Where do time and memory go, layer by layer, and where does a plan cut? ``plot_profile``."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.plot.style import (
    BOUND_COLOR,
    PHASE_COLORS,
    byte_unit,
    check_plan,
    check_profile,
    new_figure,
)

__all__ = ["plot_profile"]

_BARS = 200  # up to this many layers, one bar per layer; beyond, one filled outline per series
_NAMED_TICKS = 40  # up to this many layers, every layer's name is a tick label
_FULL_NAME = 0.05  # a run of a stage this wide (share of the axis) is labelled "stage s" ...
_NUMBER_ONLY = 0.015  # ... this wide "s"; a narrower run is only shaded (it would overlap)


def plot_profile(profile: Profile, plan: Plan | None = None, *, title: str | None = None) -> Figure:
    """Per-layer time (top) and memory (bottom) along the profile's topological order.

    With a ``plan``, its cuts are drawn as dashed lines and its stages shaded and labelled.
    Raises PlotError for arguments of the wrong type and PlanError when the plan was made for
    another model (other layers or graph fingerprint).
    """
    profile = check_profile(profile, "plot_profile")
    stage: list[int] | None = None
    if plan is not None:
        plan = check_plan(plan, "plot_profile")
        plan.check(profile.layers, profile.fingerprint)
        where = {name: s for s, names in enumerate(plan.stages) for name in names}
        stage = [where[name] for name in profile.layers]
    df = profile.df
    n = len(df)
    x = np.arange(n)
    fig = new_figure(min(16.0, max(8.0, 0.22 * n + 3.0) + 2.0), 6.0)  # + 2 in for the legends
    ax_t, ax_m = fig.subplots(2, 1, sharex=True)

    fwd, bwd = df["fwd_ms"].to_numpy(float), df["bwd_ms"].to_numpy(float)
    bar = ax_t.bar if n <= _BARS else functools.partial(_filled_steps, ax_t)
    bar(x, fwd, 0.8, color=PHASE_COLORS["forward"], label="forward")
    bar(x, bwd, 0.8, bottom=fwd, color=PHASE_COLORS["backward"], label="backward")
    ax_t.set_ylabel("time per micro-batch (ms)")
    ax_t.margins(y=0.15)
    ax_t.set_title("time per layer")

    # parameters are held once, saved activations once per micro-batch in flight: the axis is
    # plain memory and each bar's legend entry says which it is
    params, saved = df["param_bytes"].to_numpy(float), df["saved_bytes"].to_numpy(float)
    unit, size = byte_unit(max(params.max(), saved.max(), 1.0))
    bar = ax_m.bar if n <= _BARS else functools.partial(_filled_steps, ax_m)
    bar(x - 0.2, params / size, 0.4, color="#55A868", label="parameters (one copy)")
    bar(x + 0.2, saved / size, 0.4, color="#CCB974", label="saved for backward (per micro-batch)")
    ax_m.set_ylabel(f"memory ({unit})")
    ax_m.set_title("memory per layer")
    ax_m.set_xlabel("layer (topological order)")
    if n <= _NAMED_TICKS:
        ax_m.set_xticks(x, profile.layers, rotation=90, fontsize=7)

    if stage is not None:
        _draw_stages(ax_t, stage, names=True)
        _draw_stages(ax_m, stage, names=False)
    for ax in (ax_t, ax_m):  # legends beside the axes: inside they hide bars and stage names
        ax.set_xlim(-0.6, n - 0.4)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    meta = profile.meta
    head = f"profile of {meta.get('model', 'a model')}: {n} layers on {profile.device}"
    if "micro_batch_size" in meta:
        head += f", micro-batch of {meta['micro_batch_size']}"
    if plan is not None:
        head += f"; {plan.num_stages} stages by {plan.method}"
    fig.suptitle(title or head)
    return fig


def _filled_steps(ax: Axes, x: Any, heights: Any, width: float, *, bottom: Any = 0.0, color: str,
                  label: str) -> None:
    """``ax.bar(x, heights, width, bottom=...)`` drawn as one filled outline: the same boxes, one
    artist instead of one Rectangle per layer (matplotlib spends ~1.5 ms on each, seconds for
    hundreds of layers); the gaps between the boxes are steps of height 0."""
    x = np.asarray(x, float)
    base = np.broadcast_to(np.asarray(bottom, float), x.shape)
    edges = np.stack([x - width / 2, x + width / 2], axis=1).ravel()
    tops = np.stack([base + np.asarray(heights, float), base], axis=1).ravel()[:-1]
    lows = np.stack([base, base], axis=1).ravel()[:-1]
    ax.stairs(tops, edges, baseline=lows, fill=True, color=color, label=label, lw=0)


def _draw_stages(ax: Axes, stage: list[int], *, names: bool) -> None:
    """Shade each run of same-stage layers, label it on top and dash the cuts between runs."""
    runs: list[tuple[int, int, int]] = []  # (stage, first, last)
    for i, s in enumerate(stage):
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1], i)
        else:
            runs.append((s, i, i))
    n = len(stage)
    for r, (s, first, last) in enumerate(runs):
        ax.axvspan(first - 0.5, last + 0.5, color=f"C{s % 10}", alpha=0.08, lw=0)
        share = (last - first + 1) / n  # of the axis' width
        if names and share >= _NUMBER_ONLY:
            ax.text((first + last) / 2, 0.97, f"stage {s}" if share >= _FULL_NAME else str(s),
                    transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8,
                    color=f"C{s % 10}")
        if r > 0:
            ax.axvline(first - 0.5, color=BOUND_COLOR, ls="--", lw=1,
                       label="stage cut" if r == 1 else None)
