"""What every autopipe figure shares: phase colours, byte units, a fresh Figure, input checks.

[Note: figures without pyplot] Every plot function builds a ``matplotlib.figure.Figure``
directly and never touches ``matplotlib.pyplot``: no global figure registry, no backend switch,
nothing left open. ``fig.savefig("x.png")`` renders through Agg without a display, and a
notebook shows a returned Figure through its inline backend as usual.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PlotError

__all__ = [
    "PHASE_COLORS",
    "byte_unit",
    "new_figure",
    "check_plan",
    "check_profile",
    "stage_label",
]

PHASE_COLORS: dict[str, str] = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight": "#C9A227",  # a split backward's weight gradients ([Note: split backward])
    "recompute": "#8172B3",
    "transfer": "#937860",
    "allgather": "#55A868",  # the data-parallel collectives ([Note: pipeline x data parallel])
    "allreduce": "#64B5CD",
    "reducescatter": "#DA8BC3",
}
LIMIT_COLOR = "#C44E52"
BOUND_COLOR = "#222222"

_UNITS: tuple[tuple[str, int], ...] = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(largest: float) -> tuple[str, float]:
    """The unit to draw bytes in so that ``largest`` reads as a number >= 1: (name, bytes)."""
    for name, size in _UNITS:
        if largest >= size:
            return name, float(size)
    return "B", 1.0


def new_figure(width: float, height: float) -> Figure:
    """A pyplot-free figure (see [Note: figures without pyplot]) with a tight layout."""
    return Figure(figsize=(width, height), layout="constrained")


def check_plan(plan: Any, what: str) -> Plan:
    if not isinstance(plan, Plan):
        raise PlotError(f"{what} needs an autopipe.Plan, got {type(plan).__name__}; "
                        f"make one with autopipe.partition(...) or autopipe.Plan.load(path)")
    return plan


def check_profile(profile: Any, what: str) -> Profile:
    if not isinstance(profile, Profile):
        raise PlotError(f"{what} needs an autopipe.Profile, got {type(profile).__name__}; "
                        f"load one with autopipe.Profile.load('profiles/NAME.csv')")
    return profile


def stage_label(plan: Plan, s: int) -> str:
    """Tick label of stage ``s``: its index, and its device when that says more."""
    name = plan.devices[s].name
    return str(s) if name == f"stage{s}" else f"{s}\n{name}"
