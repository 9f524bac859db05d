"""Decision: what a plan decides, as one frozen value that both runtimes take. Torch-free.

    decision = plan.decision                                  # a Plan's, from autopipe.partition
    decision = Decision.for_stages(2, chunks=8)               # or by hand, for hand-made stages
    print(decision)   # 2 stages | 8 micro-batches | recompute except_last | gpipe | fp32
    GPipe(stages, devices, decision=decision)
    DistributedPipeline(stages, indices, decision=decision, wires=wires, loss_fn=loss_fn)
    Decision.from_json(decision.to_json()) == decision        # plain JSON, saved and loaded

[Note: a plan's decision] A Plan holds two things: what to run (this value) and what that is
predicted to cost (its times, memory and breakdown, which only the planner reads). The
runtimes take the decision alone, as one value, made and checked once where it is made
(``Plan.decision``, or ``dataclasses.replace`` of it with what the caller overrides, which
checks again): every field is validated here in ``__post_init__``, so a runtime never sees a
half-checked mode or schedule. What is not decided by a plan stays a runtime argument: the
modules, their devices or rank, the wires, the loss, the timeouts.

It lives in ``executor`` beside ``executor.spec``, whose rules it applies, so that the planner
(``autopipe.core.plan``, torch-free) and both runtimes share one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from executor.spec import (
    DATA_PARALLEL_MODES,
    MERGE_RULES,
    SCHEDULES,
    check_merge_rule,
    check_precision,
    check_stage_recompute,
)

__all__ = ["Decision", "runtime_decision"]


@dataclass(frozen=True)
class Decision:
    """What to run: the stages and where, micro-batches, recomputation, schedule and replicas.

    Every field is checked when the value is made (ValueError, one line naming the fix), so a
    Decision in hand is a valid one; ``dataclasses.replace`` checks the new value again.
    """

    stages: tuple[tuple[str, ...], ...]
    """The layers of each stage, in order (a stage of hand-made modules: ``()``, unnamed)."""
    chunks: int
    """Micro-batches per mini-batch."""
    recompute: tuple[str, ...]
    """One recompute mode per stage (executor.spec.RECOMPUTE_MODES); one mode is spread."""
    devices: tuple[str, ...] = ()
    """The device each stage was planned for (``()``: not recorded); a runtime places by its own."""
    schedule: str = "gpipe"
    """The pipeline schedule (executor.spec.SCHEDULES; executor.GPipe runs ``gpipe`` only)."""
    merge_backward: str = MERGE_RULES[0]
    """Zero-bubble schedules: which adjacent backward halves run whole ([Note: adjacent I and W])."""
    data_parallel: int = 1
    """Replicas of the pipeline ([Note: pipeline x data parallel])."""
    dp_mode: str = DATA_PARALLEL_MODES[0]
    """How the replicas share gradients: ``ddp`` or ``fsdp``."""
    recompute_layers: tuple[str, ...] = ()
    """Layers recomputed inside stages that keep the others ([Note: recomputed layers])."""
    precision: str = "fp32"
    """What every stage computes in: fp32, or autocast to bf16 / fp16 over fp32 parameters."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a decision needs at least one stage")
        set_ = object.__setattr__  # frozen: normalise lists to tuples, one mode to one per stage
        set_(self, "stages", tuple(tuple(s) for s in self.stages))
        chunks = self.chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int):
            raise ValueError(f"chunks={chunks!r} is not a number of micro-batches; pass an int >= 1")
        if chunks < 1:
            raise ValueError(f"chunks={chunks} < 1: need at least one micro-batch; use chunks >= 1")
        set_(self, "recompute", tuple(check_stage_recompute(self.recompute, len(self.stages))))
        set_(self, "devices", tuple(str(d) for d in self.devices))
        if self.devices and len(self.devices) != len(self.stages):
            raise ValueError(f"a decision of {len(self.stages)} stages names {len(self.devices)} "
                             "devices; give one device per stage, or none")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        check_merge_rule(self.merge_backward)
        replicas = self.data_parallel
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"data_parallel={replicas!r} is not a number of replicas; pass an int >= 1")
        if self.dp_mode not in DATA_PARALLEL_MODES:
            raise ValueError(f"dp_mode={self.dp_mode!r} is unknown; use one of {', '.join(DATA_PARALLEL_MODES)}")
        set_(self, "recompute_layers", tuple(self.recompute_layers))
        check_precision(self.precision)

    @classmethod
    def for_stages(cls, stages: int, *, chunks: int, recompute: str | Sequence[str] = "except_last",
                   **rest: Any) -> Decision:
        """A decision for ``stages`` hand-made (unnamed) stages, as a runtime built without a
        plan takes it: the other fields as in the class (``schedule="gpipe"``, ...)."""
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages={stages!r}: a pipeline needs at least one stage")
        return cls(((),) * stages, chunks, tuple(check_stage_recompute(recompute, stages)), **rest)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def replace(self, **changes: Any) -> Decision:
        """This decision with ``changes`` (checked again), e.g. a caller's own ``chunks``."""
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists for tuples); :meth:`from_json` reads it back."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decision:
        """A decision from :meth:`to_json`'s dict; a key it does not know is refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"a decision has no field {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def __str__(self) -> str:
        modes = sorted(set(self.recompute))
        recompute = modes[0] if len(modes) == 1 else "/".join(self.recompute)
        parts = [f"{self.num_stages} stage{'s' if self.num_stages > 1 else ''}"
                 + (f" on {', '.join(self.devices)}" if self.devices else ""),
                 f"{self.chunks} micro-batch{'es' if self.chunks > 1 else ''}",
                 f"recompute {recompute}", self.schedule, self.precision]
        if self.merge_backward != MERGE_RULES[0]:
            parts.append(f"merge {self.merge_backward}")
        if self.data_parallel > 1:
            parts.append(f"x{self.data_parallel} {self.dp_mode}")
        if self.recompute_layers:
            parts.append(f"{len(self.recompute_layers)} layer(s) recomputed")
        return " | ".join(parts)


# A runtime built by hand takes these loose arguments, with these defaults: a Decision's own,
# and recomputation of every micro-batch but one (torchgpipe's default).
_BY_HAND: dict[str, Any] = {"recompute": "except_last", **{
    f.name: f.default for f in fields(Decision) if f.name in ("schedule", "merge_backward", "precision")}}


def runtime_decision(decision: Decision | None, stages: int, *, chunks: int | None,
                     **loose: Any) -> Decision:
    """The decision a runtime runs: ``decision`` (a plan's), or, for stages built by hand, one
    made of the runtime's loose arguments (``chunks=``, ``recompute=``, ``schedule=``,
    ``merge_backward=``, ``precision=``). With ``decision``, a loose argument must be left out
    (at its default): two answers to one question are refused, naming the one-value fix."""
    if decision is None:
        if chunks is None:
            raise ValueError("chunks= is missing: pass chunks=M (micro-batches per mini-batch), "
                             "or decision=plan.decision")
        return Decision.for_stages(stages, chunks=chunks, **loose)
    if not isinstance(decision, Decision):
        raise ValueError(f"decision={type(decision).__name__} is not an executor.Decision; pass "
                         "plan.decision, or Decision.for_stages(n, chunks=...)")
    clash = (["chunks"] if chunks is not None else []) + [
        name for name, value in loose.items() if value != _BY_HAND[name]]
    if clash:
        raise ValueError(f"{clash[0]}= and decision= were both given; pass decision="
                         f"decision.replace({clash[0]}=...) alone")
    if decision.num_stages != stages:
        raise ValueError(f"the decision has {decision.num_stages} stages but {stages} stage "
                         "module(s) were given; pass one module per stage of the decision")
    return decision
