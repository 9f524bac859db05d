"""Gantt charts of pipeline iterations: ``plot_timeline(predicted, measured)``.

Events are duck-typed: anything with ``stage``, ``microbatch``, ``phase``, ``start_ms`` and
``end_ms`` (see [Note: timeline events] in executor/spec.py) is drawn, so the simulator's
predicted and the executor's measured ``TimelineEvent``s go through the same code. A
``SimulationResult`` may be passed for its ``.timeline``.

One row per stage, one box per (micro-batch, phase) labelled with the micro-batch number;
transfers are drawn as a thin strip under the compute, since a measured copy may overlap it,
and the data-parallel collectives (all-gather, all-reduce, reduce-scatter: [Note: pipeline x
data parallel]) as one above it; strips are named in the legend only when one is wide enough
to see (zero-length ones, as with ``bandwidth=None``, are not drawn at all), and collectives
are not busy time in the bubble.
White space in a row is a bubble; a box much longer than its peers (over twice the median of
its stage and phase) is outlined as a straggler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from autopipe.errors import PlotError
from autopipe.plot.style import LIMIT_COLOR, PHASE_COLORS, new_figure
from executor.spec import DATA_PARALLEL_PHASES, PHASES

__all__ = ["plot_timeline", "bubble_fraction"]

_STRAGGLER = 2.0  # a span longer than this x its peers' median is a straggler
_VISIBLE = 1e-3  # share of the time axis, about a pixel: a shorter transfer gets no legend entry
_FIELDS = ("stage", "microbatch", "phase", "start_ms", "end_ms")
# Thin strips beside the compute, at these offsets: transfers below it, the data-parallel
# collectives ([Note: pipeline x data parallel]) above it, since they overlap other work.
_STRIPS = {"transfer": 0.3, **{p: -0.3 for p in DATA_PARALLEL_PHASES}}


@dataclass(frozen=True)
class _Span:
    stage: int
    microbatch: int
    phase: str
    start: float
    end: float


def plot_timeline(
    events: Any,
    measured: Any = None,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    sharex: bool = True,
) -> Figure:
    """Gantt chart of one iteration, or two stacked on one time axis (predicted over measured).

    ``events``: a list of timeline events (or a ``SimulationResult``); ``measured``: an optional
    second list, drawn below it. Panel names default to "predicted" for the simulator's events
    and "measured" for the executor's, or give ``labels``. With ``sharex`` both panels use the
    same time scale, so a longer iteration is visibly longer. Raises PlotError on an empty or
    malformed event list.
    """
    panels = [_spans(events, "events")]
    if measured is not None:
        panels.append(_spans(measured, "measured"))
    names = list(labels) if labels is not None else [
        _default_label(e, i) for i, e in enumerate([events, measured][: len(panels)])]
    if len(names) != len(panels):
        raise PlotError(f"labels has {len(names)} name(s) for {len(panels)} timeline(s); "
                        f"give one label per timeline")
    rows = max(max(s.stage for s in spans) + 1 for spans in panels)
    fig = new_figure(11.0, 1.0 + len(panels) * (0.9 + 0.45 * rows))
    axes: list[Axes] = list(np.atleast_1d(fig.subplots(len(panels), 1, sharex=sharex)))
    # one panel under the default title: the title names it, its own title says only the numbers
    named = len(panels) > 1 or title is not None
    for ax, spans, name in zip(axes, panels, names, strict=True):
        _draw(ax, spans, name if named else None)
    axes[-1].set_xlabel("time since the iteration started (ms)")
    axes[0].legend(*_legend(axes), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title or " vs ".join(names) + " pipeline timeline")
    return fig


def bubble_fraction(events: Any) -> float:
    """Idle share of ``stages x iteration span``: 1 - busy time / (K x span); busy time is
    the union of a stage's spans, so overlapping measured spans are not counted twice."""
    return _bubble(_spans(events, "events"))


def _bubble(spans: list[_Span]) -> float:
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    stages = sorted({s.stage for s in spans})
    if t1 <= t0:
        return 0.0
    busy = sum(_union([(s.start, s.end) for s in spans if s.stage == j
                       and s.phase not in DATA_PARALLEL_PHASES]) for j in stages)
    return 1.0 - busy / (len(stages) * (t1 - t0))


def _draw(ax: Axes, spans: list[_Span], name: str | None) -> None:
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    width = max(t1 - t0, 1e-9)
    medians = {key: float(np.median([s.end - s.start for s in spans if (s.stage, s.phase) == key]))
               for key in {(s.stage, s.phase) for s in spans}}
    counts = {key: sum(1 for s in spans if (s.stage, s.phase) == key) for key in medians}
    for phase in PHASES:
        thin = phase in _STRIPS
        mine = [s for s in spans if s.phase == phase and (s.end > s.start or not thin)]
        if not mine:
            continue
        y = [s.stage + _STRIPS.get(phase, 0.0) for s in mine]
        # a legend entry only for what shows: transfers far below a pixel are drawn, unlabelled
        seen = not thin or any(s.end - s.start >= _VISIBLE * width for s in mine)
        ax.barh(y, [s.end - s.start for s in mine], left=[s.start for s in mine],
                height=0.16 if thin else 0.56, color=PHASE_COLORS[phase], edgecolor="white",
                linewidth=0.4, label=phase if seen else None)
        for s in mine:
            duration = s.end - s.start
            if not thin and duration > 0.018 * width:
                ax.text(s.start + duration / 2, s.stage, str(s.microbatch), ha="center",
                        va="center", fontsize=7, color="white")
            key = (s.stage, s.phase)
            if not thin and counts[key] >= 3 and duration > _STRAGGLER * medians[key] > 0:
                ax.barh(s.stage, duration, left=s.start, height=0.62, fill=False,
                        edgecolor=LIMIT_COLOR, linewidth=1.5, label="straggler (> 2x median)")
    stages = sorted({s.stage for s in spans})
    ax.set_yticks(stages, [f"stage {j}" for j in stages])
    ax.set_ylim(max(stages) + 0.6, -0.6)  # stage 0 on top
    ax.set_ylabel("pipeline stage")
    numbers = (f"{_fmt_ms(t1 - t0)} ms, bubble {100 * _bubble(spans):.0f}% ({len(stages)} "
               f"stages, {len({s.microbatch for s in spans})} micro-batches)")
    ax.set_title(numbers if name is None else f"{name}: {numbers}", fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _legend(axes: Sequence[Axes]) -> tuple[list[Any], list[str]]:
    """One legend for all panels: each label once, in phase order."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    order = [p for p in PHASES if p in handles] + [k for k in handles if k not in PHASES]
    return [handles[k] for k in order], order


def _spans(events: Any, what: str) -> list[_Span]:
    if hasattr(events, "timeline"):  # a SimulationResult
        events = events.timeline
    if not isinstance(events, Iterable) or isinstance(events, str | bytes):
        raise PlotError(f"{what} must be a list of timeline events, got {type(events).__name__}; "
                        f"pass autopipe.simulate(plan).timeline or a pipe.record_timeline() event list")
    out: list[_Span] = []
    for i, e in enumerate(events):
        missing = [f for f in _FIELDS if not hasattr(e, f)]
        if missing:
            raise PlotError(f"{what}[{i}] ({type(e).__name__}) lacks field(s) {missing}; timeline "
                            f"events need {list(_FIELDS)} (executor.spec.TimelineEvent)")
        span = _Span(int(e.stage), int(e.microbatch), str(e.phase), float(e.start_ms), float(e.end_ms))
        if span.phase not in PHASES:
            raise PlotError(f"{what}[{i}] has phase {span.phase!r}; phases are {list(PHASES)}")
        if not (math.isfinite(span.start) and math.isfinite(span.end)) or span.end < span.start:
            raise PlotError(f"{what}[{i}] spans {span.start} .. {span.end} ms; need finite "
                            f"start_ms <= end_ms")
        if span.stage < 0:
            raise PlotError(f"{what}[{i}] has stage {span.stage}; stages are numbered from 0")
        out.append(span)
    if not out:
        raise PlotError(f"{what} is empty: nothing to draw; trace an iteration "
                        f"(`with pipe.record_timeline() as events: ...`) or pass simulate(plan).timeline")
    return out


def _default_label(events: Any, index: int) -> str:
    items = getattr(events, "timeline", events)
    first = next(iter(items), None)
    measured = getattr(first, "measured", None)
    if measured is not None:
        return "measured" if measured else "predicted"
    return "timeline" if index == 0 else "second timeline"


def _fmt_ms(t: float) -> str:
    return f"{t:.3g}" if t < 100 else f"{t:,.0f}"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
