"""The torch.distributed.pipelining schedule that runs each of executor.spec.SCHEDULES, what it
accepts, and how it is built over one rank's stages.

    gpipe            PrefetchGPipe ([Note: receive ahead]), else torch's ScheduleGPipe
    1f1b             Schedule1F1B
    interleaved1f1b  ScheduleInterleaved1F1B                  several stages per rank, s on s % W
    interleaved_zb   ScheduleInterleavedZeroBubble (ZB1P)     the same layout, each backward split
    zbv              ScheduleZBVZeroBubble                    2 per rank in a V: r and 2W - 1 - r
    dualpipev        ScheduleDualPipeV                        the V, M >= 2W

The last three split each backward ([Note: zero-bubble schedules] in executor/spec.py), which
the stages run themselves ([Note: split backward on ranks] in executor/ranks/split_backward.py), but
where a W follows its I at once ([Note: adjacent I and W] in executor/spec.py).
:func:`check_layout` refuses in one line what torch would refuse with a traceback, or not at all
(stages on the wrong rank), before any process group is made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from executor._torch_compat import merge_adjacent_backward, prefetch_support, warn_no_prefetch
from executor.errors import DistributedError
from executor.ranks.prefetch import PrefetchGPipe
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    check_schedule,
    stage_rank,
)

__all__ = ["schedule_class", "check_layout", "build_schedule"]

_SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": PrefetchGPipe,  # [Note: receive ahead]
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
assert tuple(_SCHEDULE_CLASSES) == SCHEDULES, "executor.spec.SCHEDULES lists the runtime's schedules"


def schedule_class(schedule: str) -> type:
    """The torch schedule class that runs ``schedule`` (one of executor.spec.SCHEDULES)."""
    if schedule not in _SCHEDULE_CLASSES:
        raise DistributedError(f"schedule={schedule!r} is unknown; use one of {list(SCHEDULES)}")
    if schedule == "gpipe":
        problem = prefetch_support()
        if problem is not None:
            warn_no_prefetch(problem)
            return ScheduleGPipe
    return _SCHEDULE_CLASSES[schedule]


def check_layout(schedule: str, num_stages: int, ranks: int, chunks: int, rank: int,
                 indices: Sequence[int]) -> None:
    """DistributedError in one line unless ``schedule`` runs ``num_stages`` stages on ``ranks``
    ranks over ``chunks`` micro-batches (executor.spec.check_schedule) with this ``rank``
    holding stages ``indices`` ([Note: stage to rank] in executor/spec.py)."""
    try:
        check_schedule(schedule, num_stages, ranks, chunks)
    except ValueError as err:
        raise DistributedError(str(err)) from None
    expected = [i for i in range(num_stages) if stage_rank(schedule, i, ranks) == rank]
    if sorted(indices) != expected:
        raise DistributedError(f"schedule={schedule!r} runs stages {expected} of {num_stages} on rank {rank} of "
                               f"{ranks}, but this rank was given stages {list(indices)}; pass those stages")


def build_schedule(kind: type, schedule: str, stages: list[Any], chunks: int,
                   loss: Callable[[Any, Any], Any], merge: str = "unwaited") -> Any:
    """``schedule``'s torch schedule (of class ``kind``, :func:`schedule_class`'s) over this
    rank's PipelineStages; gradients left unscaled (the pipeline takes the mean itself); under
    the zero-bubble schedules each I that its W follows at once run whole as rule ``merge``
    says ([Note: adjacent I and W] in executor/spec.py)."""
    if schedule in MULTI_STAGE_SCHEDULES:
        built = kind(stages, chunks, loss_fn=loss, scale_grads=False)
        if schedule in ZERO_BUBBLE_SCHEDULES:
            merge_adjacent_backward(built, schedule, stages[0].group_size, merge)
        return built
    return kind(stages[0], chunks, loss_fn=loss, scale_grads=False)
