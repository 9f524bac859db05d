from __future__ import annotations

import pytest

from executor.errors import ExecutorError
from executor.local.fill_drain import clock_cycles, num_clocks


def test_clock_cycles_exact_3x3() -> None:
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


def test_clock_cycles_exact_more_stages_than_microbatches() -> None:
    assert list(clock_cycles(2, 4)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(1, 1), (0, 2)],
        [(1, 2), (0, 3)],
        [(1, 3)],
    ]


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_every_pair_once_in_dependency_order(m: int, n: int) -> None:
    cycles = list(clock_cycles(m, n))
    assert len(cycles) == num_clocks(m, n) == m + n - 1
    clock_of = {pair: k for k, cycle in enumerate(cycles) for pair in cycle}
    assert sorted(clock_of) == [(i, j) for i in range(m) for j in range(n)]
    for (i, j), k in clock_of.items():
        if j > 0:
            assert clock_of[(i, j - 1)] == k - 1  # the previous stage ran just before
        if i > 0:
            assert clock_of[(i - 1, j)] == k - 1  # the previous micro-batch ran just before
    for cycle in cycles:  # ascending stages within a clock; one micro-batch per stage
        stages = [j for _, j in cycle]
        assert stages == sorted(set(stages))


def test_empty_and_bad_counts() -> None:
    assert list(clock_cycles(0, 3)) == []
    assert num_clocks(0, 3) == 0
    with pytest.raises(ExecutorError, match="negative count"):
        list(clock_cycles(-1, 2))
