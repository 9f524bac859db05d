"""autopipe/solvers/baselines.py against brute force, layers without parameters included."""

from __future__ import annotations

import itertools
import sys

import pytest

from autopipe.errors import PartitionError
from autopipe.solvers.baselines import blockpartition_sizes, params_sizes, uniform_sizes


def _largest(values: tuple[int, ...], sizes: list[int]) -> int:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return max(sum(values[a:b]) for a, b in itertools.pairwise(bounds))


def _least_largest(values: tuple[int, ...], k: int) -> int:
    n = len(values)
    return min(_largest(values, [b - a for a, b in itertools.pairwise((0, *cuts, n))])
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_params_sizes_is_a_least_largest_split_into_non_empty_stages() -> None:
    # activations, norms without affine and the like hold no parameters: zeros included
    for n in range(1, 6):
        for values in itertools.product((0, 1, 3), repeat=n):
            for k in range(1, n + 1):
                sizes = params_sizes(values, k)
                assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1, (values, k, sizes)
                assert _largest(values, sizes) == _least_largest(values, k), (values, k, sizes)


def test_uniform_sizes_give_the_first_stages_the_extra_layers() -> None:
    assert uniform_sizes(7, 3) == [3, 2, 2]
    assert uniform_sizes(6, 3) == [2, 2, 2]
    assert uniform_sizes(3, 3) == [1, 1, 1]


def test_blockpartition_without_torchgpipe_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchgpipe.balance", None)  # as if not installed
    with pytest.raises(PartitionError) as info:
        blockpartition_sizes([1.0, 2.0, 3.0], 2)
    assert str(info.value) == "method='blockpartition' calls torchgpipe's algorithm: pip install torchgpipe"
    assert info.value.__cause__ is None and info.value.__suppress_context__
