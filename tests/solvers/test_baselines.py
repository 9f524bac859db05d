from __future__ import annotations

import pytest

from autopipe.errors import PartitionError
from autopipe.solvers.baselines import (
    blockpartition_sizes,
    params_sizes,
    sizes_to_assignment,
    uniform_sizes,
)


def test_uniform_sizes() -> None:
    assert uniform_sizes(10, 3) == [4, 3, 3]
    assert uniform_sizes(3, 3) == [1, 1, 1]
    with pytest.raises(PartitionError, match="stages=4 > 3 layers"):
        uniform_sizes(3, 4)


def test_params_sizes_balances_parameters() -> None:
    assert params_sizes([1, 1, 1, 1, 4], 2) == [4, 1]
    assert params_sizes([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert sum(params_sizes([3] * 7, 3)) == 7


def test_sizes_to_assignment() -> None:
    assert sizes_to_assignment([2, 1]) == [0, 0, 1]


def test_blockpartition_calls_torchgpipe() -> None:
    pytest.importorskip("torchgpipe")
    from torchgpipe.balance import blockpartition

    costs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    expected = [len(b) for b in blockpartition.solve(costs, partitions=3)]
    assert blockpartition_sizes(costs, 3) == expected
    assert sum(expected) == 6
