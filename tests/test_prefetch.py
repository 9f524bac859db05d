"""PrefetchGPipe's numerics are covered by tests/test_distributed.py, whose "gpipe" runs use it
and compare loss and every gradient with one process; here: that it is the one selected."""

from __future__ import annotations

from torch.distributed.pipelining import ScheduleGPipe

from executor.distributed import SCHEDULES
from executor.prefetch import PREFETCH_AVAILABLE, PrefetchGPipe


def test_gpipe_schedule_receives_ahead() -> None:
    assert PREFETCH_AVAILABLE  # the private torch helpers exist in the tested torch
    assert SCHEDULES["gpipe"] is PrefetchGPipe
    assert issubclass(PrefetchGPipe, ScheduleGPipe)
    # the override replaces exactly the method ScheduleGPipe defines for one iteration
    assert "_step_microbatches" in vars(ScheduleGPipe)
    assert "_step_microbatches" in vars(PrefetchGPipe)
