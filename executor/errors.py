"""Errors raised by the executor; all are ``ValueError`` subclasses with one-line messages.

The executor imports torch only, so it cannot share ``autopipe.errors``; the planner may
catch :class:`ExecutorError` to report runtime configuration problems in its own words.
"""

from __future__ import annotations

__all__ = ["ExecutorError", "MicroBatchError", "PlacementError", "DistributedError", "CheckpointError"]


class ExecutorError(ValueError):
    """Base class: a pipeline that cannot be built or run as configured."""


class MicroBatchError(ExecutorError):
    """Inputs cannot be split into micro-batches, or outputs cannot be gathered."""


class PlacementError(ExecutorError):
    """Stages, devices or parameters cannot be placed as requested."""


class DistributedError(ExecutorError):
    """A distributed pipeline that cannot be built or run as configured."""


class CheckpointError(ExecutorError):
    """A checkpoint that cannot be saved or loaded as asked (another model or optimizer, a
    truncated part, a missing folder); nothing already saved was changed."""
