"""The precision a profile was measured under, and the one-line warning when a pipeline differs.

A profile measured under ``precision="bf16"`` holds bf16 times and bytes (autopipe.profile:
[Note: profiling under a precision] in autopipe/frontend/profiling/harness/under_autocast.py), and a
plan made from it predicts a bf16 pipeline ([Note: mixed precision memory] in autopipe/core/cost.py). A
profile or plan without the field was measured in fp32, as every one was before precisions
existed ([Note: plan fields over time] in plan_checks.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autopipe.errors import ProfileError
from executor.spec import check_precision

__all__ = ["DEFAULT_PRECISION", "precision_mismatch", "precision_of"]

DEFAULT_PRECISION = "fp32"


def precision_of(meta: Mapping[str, Any]) -> str:
    """The precision in a profile's metadata; ``"fp32"`` when it records none (older profiles)."""
    value = meta.get("precision", DEFAULT_PRECISION)
    try:
        return check_precision(value)
    except ValueError as err:
        raise ProfileError(f"the profile's meta {err}; re-run autopipe profile") from None


def precision_mismatch(planned: str, pipeline: str, what: str = "plan") -> str | None:
    """One line saying that a pipeline computing in ``pipeline`` was planned or profiled (``what``:
    "plan" or "profile") under ``planned``, so its predicted times and memory are another
    precision's; None when they agree."""
    if check_precision(planned) == check_precision(pipeline):
        return None
    return (f"the {what} was measured under precision={planned!r} but the pipeline computes in "
            f"{pipeline!r}: its predicted times and memory are {planned}'s; profile with "
            f"precision={pipeline!r} (autopipe profile --precision {pipeline}) to plan for it")
