"""The GPipe fill-drain schedule as a pure function of (micro-batches, stages).

At clock ``k`` stage ``j`` works on micro-batch ``k - j``: micro-batches enter the first
stage one clock apart and flow down the chain, so the pipeline fills for ``n - 1`` clocks,
runs full, and drains for ``n - 1`` clocks: ``m + n - 1`` clocks in all. Within a clock the
pairs are listed by ascending stage (so descending micro-batch); :mod:`executor.local.gpipe` relies
on that order when it chains micro-batch ``i - 1`` behind micro-batch ``i`` for backward.

Backward needs no schedule of its own: autograd runs it in reverse, ordered by the
dependencies :mod:`executor.local.gpipe` adds in forward. (Idea and layout from torchgpipe.)
"""

from __future__ import annotations

from collections.abc import Iterator

from executor.errors import ExecutorError

__all__ = ["clock_cycles", "num_clocks"]


def num_clocks(m: int, n: int) -> int:
    """Clock cycles of a fill-drain pass of ``m`` micro-batches over ``n`` stages."""
    return m + n - 1 if m > 0 and n > 0 else 0


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per clock, the ``(microbatch, stage)`` pairs that run concurrently.

    >>> list(clock_cycles(3, 2))
    [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    """
    if m < 0 or n < 0:
        raise ExecutorError(
            f"clock_cycles(m={m}, n={n}): negative count; micro-batches and stages must be >= 0"
        )
    for clock in range(num_clocks(m, n)):
        first_stage = max(0, clock - m + 1)
        last_stage = min(clock, n - 1)
        yield [(clock - j, j) for j in range(first_stage, last_stage + 1)]
