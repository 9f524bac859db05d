"""Whether a split fits a graph: every layer in exactly one non-empty stage, no edge running
backwards and, for a saved plan, the graph's fingerprint its own (or another micro-batch's)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from autopipe.core.profile_table import fingerprint_mismatch, micro_batch_text
from autopipe.errors import AutopipeError, PlanError

if TYPE_CHECKING:
    from autopipe.core.plan import Plan

__all__ = ["assign_stages", "check_plan"]


def check_plan(plan: Plan, layers: Sequence[str], fingerprint: str | None, *,
               micro_batch_size: int | None = None) -> None:
    """Raise PlanError unless ``plan`` was made for a graph with these layers (``Plan.check``)."""
    differs = fingerprint_mismatch(plan.fingerprint, fingerprint)
    if plan.fingerprint is not None and plan.fingerprint.startswith("*.") and fingerprint:
        mine, theirs = plan.fingerprint[2:], fingerprint.partition(".")[2]  # structure only
        differs = None if not theirs or theirs == mine else "model"
        if differs is None and micro_batch_size not in (None, plan.micro_batch_size):
            differs = "shape"
    head = f"plan was made for graph fingerprint {plan.fingerprint} but this graph has {fingerprint}"
    if differs == "model":
        raise PlanError(f"{head}: the plan is for another model (its layers or parameter shapes "
                        f"differ); re-run autopipe profile and autopipe partition for this model")
    mine = micro_batch_text({"micro_batch_size": plan.micro_batch_size,
                             "batch_size": plan.batch_size, "chunks": plan.chunks})
    this = f", this one's {micro_batch_size} rows" if micro_batch_size is not None else ""
    if differs == "shape":
        raise PlanError(
            f"{head}: same model, another micro-batch shape (the plan's micro-batch is "
            f"{mine}{this}; a micro-batch is the first ceil(batch / chunks) rows); use the "
            f"plan's batch size and chunks, or re-run autopipe profile and autopipe partition "
            f"for this batch and chunks"
        )
    if differs == "graph":
        known = f"; the plan's micro-batch is {mine}{this}" if plan.micro_batch_size else ""
        fix = "use the plan's batch size and chunks, or " if plan.micro_batch_size else ""
        raise PlanError(f"{head} (another model or micro-batch shape{known}); {fix}re-run "
                        f"autopipe profile and autopipe partition for this model/batch")
    _check_layers({n for names in plan.stages for n in names}, list(layers), "the graph")


def _check_layers(
    have: set[str], layers: Sequence[str], what: str, error: type[AutopipeError] = PlanError
) -> None:
    unknown = sorted(have - set(layers))
    missing = [n for n in layers if n not in have]
    if unknown:
        raise error(f"plan names {len(unknown)} layer(s) not in {what}, e.g. {unknown[:3]}; "
                    f"the plan is for another model: re-run autopipe partition")
    if missing:
        raise error(f"plan leaves {len(missing)} layer(s) of {what} unassigned, e.g. {missing[:3]}; "
                    f"the plan is for another model: re-run autopipe partition")


def assign_stages(
    stages: Sequence[Sequence[str]],
    layers: Sequence[str],
    edges: Iterable[tuple[str, str, Any]],
    what: str,
    error: type[AutopipeError] = PlanError,
) -> dict[str, int]:
    """Layer -> stage index, after checking that ``stages`` lists every layer exactly once, in
    non-empty stages, with no edge running from a later stage back to an earlier one."""
    if not stages:
        raise error("a plan needs at least one stage; got an empty stage list")
    where: dict[str, int] = {}
    for s, names in enumerate(stages):
        if not names:
            raise error(f"stage {s} of {len(stages)} is empty; every stage needs a layer")
        for name in names:
            if name in where:
                raise error(f"layer {name!r} is in stage {where[name]} and stage {s}; list it once")
            where[name] = s
    _check_layers(set(where), layers, what, error)
    for src, dst, _ in edges:
        if where[src] > where[dst]:
            raise error(
                f"edge {src!r} (stage {where[src]}) -> {dst!r} (stage {where[dst]}) runs backwards: "
                f"stages must follow the graph's order; move {dst!r} to stage >= {where[src]}"
            )
    return where
