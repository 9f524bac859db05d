"""CostOptions: how stages run (micro-batches, recomputation, optimizer, bandwidth, ties, schedule,
replicas), each option checked once, in one PartitionError line, when the value is made."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopipe.core.cost import OPTIMIZER_FACTOR
from autopipe.core.data_parallel import check_data_parallel
from autopipe.core.stage_memory import Terms, stage_terms
from autopipe.core.transfer import DEFAULT_BANDWIDTH
from autopipe.errors import PartitionError
from executor.spec import (
    RECOMPUTE_MODES,
    SCHEDULES,
    check_merge_rule,
    check_stage_recompute,
    recomputed_microbatches,
)

__all__ = ["CostOptions"]


@dataclass(frozen=True)
class CostOptions:
    """How stages run: micro-batches, recomputation (one mode, or one per stage), optimizer state,
    bandwidth between stages, tied parameters, the pipeline schedule and its replicas."""

    chunks: int = 8
    recompute: str | Sequence[str] = "except_last"  # a list becomes a tuple
    optimizer: str = "adam"
    bandwidth: float | None = DEFAULT_BANDWIDTH
    ties: str = "share"
    schedule: str = "gpipe"
    data_parallel: int = 1  # [Note: pipeline x data parallel]
    dp_mode: str = "ddp"
    recompute_layers: tuple[str, ...] = ()  # [Note: recomputed layers], in stages that never recompute
    merge: str = "unwaited"  # the zero-bubble schedules' merge rule ([Note: adjacent I and W])
    segment_starts: tuple[str, ...] = ()  # recomputed layers that start a segment of their own

    def __post_init__(self) -> None:
        for name in ("recompute_layers", "segment_starts"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise PartitionError(f"chunks={self.chunks!r}: need an integer number of micro-batches >= 1")
        if not isinstance(self.recompute, str | tuple):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if isinstance(self.recompute, str) and self.recompute not in RECOMPUTE_MODES:
            raise PartitionError(f"recompute={self.recompute!r}: choose one of {list(RECOMPUTE_MODES)}")
        if not isinstance(self.recompute, str):
            self.modes(len(self.recompute))  # each entry a mode
        if self.optimizer not in OPTIMIZER_FACTOR:
            raise PartitionError(f"optimizer={self.optimizer!r}: choose one of {list(OPTIMIZER_FACTOR)}")
        if self.ties not in ("share", "colocate"):
            raise PartitionError(f"ties={self.ties!r}: choose 'share' or 'colocate'")
        if self.bandwidth is not None and self.bandwidth < 0:
            raise PartitionError(f"bandwidth={self.bandwidth}: need bytes/s >= 0 (0 or None = free)")
        if self.schedule not in SCHEDULES:
            raise PartitionError(f"schedule={self.schedule!r}: choose one of {list(SCHEDULES)}")
        check_data_parallel(self.data_parallel, self.dp_mode)
        try:
            check_merge_rule(self.merge)
        except ValueError as err:
            raise PartitionError(str(err)) from None

    @property
    def ms_per_byte(self) -> float:
        return 0.0 if not self.bandwidth else 1000.0 / self.bandwidth

    def modes(self, stages: int) -> list[str]:
        """Each stage's recompute mode ([Note: per-stage recomputation] in executor/spec.py)."""
        try:
            return check_stage_recompute(self.recompute, stages)
        except ValueError as err:
            raise PartitionError(str(err)) from None

    def recomputed(self, stages: int) -> list[int]:
        """How many micro-batches each stage recomputes."""
        return [recomputed_microbatches(mode, self.chunks) for mode in self.modes(stages)]

    def terms(self, stages: int, ranks: int | None = None) -> list[Terms]:
        """Each stage's activation terms ([Note: stage memory]) under this schedule."""
        return [stage_terms(self.schedule, s, stages, self.chunks, r, ranks, self.merge)
                for s, r in enumerate(self.recomputed(stages))]
