"""Errors raised by autopipe's public entry points.

Every error is a ``ValueError`` subclass whose message is one line naming the rule that was
broken, the values observed, and what to run instead. Nothing deep inside torch should reach a
user of the CLI or the Python API without being translated into one of these.
"""

from __future__ import annotations

__all__ = [
    "AutopipeError",
    "TraceError",
    "ProfileError",
    "PartitionError",
    "PlanError",
    "BuildError",
    "PlotError",
]


class AutopipeError(ValueError):
    """Base class of every error autopipe raises on bad input."""


class TraceError(AutopipeError):
    """The model could not be turned into a LayerGraph."""


class ProfileError(AutopipeError):
    """A profile could not be measured, loaded, or does not match the model."""


class PartitionError(AutopipeError):
    """No partition satisfies the request (stages, memory, devices)."""


class PlanError(AutopipeError):
    """A plan is malformed or does not match the graph or profile it is used with."""


class BuildError(AutopipeError):
    """A plan could not be turned into stage modules or a runnable pipeline."""


class PlotError(AutopipeError):
    """Figures cannot be drawn from the given plan, profile or events, or not saved where asked."""


def first_line(err: BaseException) -> str:
    """``"ErrorType: first line of its message"`` (at most 200 characters of it): what a one-line
    message quotes from an exception raised deep inside torch or a user's code."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")
