"""autopipe/solvers/baselines.py against brute force, layers without parameters included."""

from __future__ import annotations

import itertools
import subprocess
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
    from autopipe.solvers import baselines

    monkeypatch.setattr(baselines.importlib.util, "find_spec", lambda name: None)  # as if not installed
    baselines._blockpartition.cache_clear()
    try:
        with pytest.raises(PartitionError) as info:
            blockpartition_sizes([1.0, 2.0, 3.0], 2)
    finally:
        baselines._blockpartition.cache_clear()
    assert str(info.value) == "method='blockpartition' calls torchgpipe's algorithm: pip install torchgpipe"
    assert info.value.__cause__ is None and info.value.__context__ is None  # one line, no chain


def test_blockpartition_is_torchgpipes_own_and_imports_no_torch() -> None:
    # torchgpipe's package imports torch; its algorithm's file does not, nor may the planner
    code = ("import sys\n"
            "from autopipe.solvers.baselines import blockpartition_sizes\n"
            "print(blockpartition_sizes([5.0, 1.0, 1.0, 1.0, 1.0, 5.0], 3), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    from torchgpipe.balance import blockpartition

    expected = [len(b) for b in blockpartition.solve([5.0, 1.0, 1.0, 1.0, 1.0, 5.0], partitions=3)]
    assert done.stdout.split() == [str(expected).split()[0], *str(expected).split()[1:], "False"]
