"""Baseline splits to compare against: equal layer counts, DeepSpeed's parameter balance, and
torchgpipe's ``blockpartition`` (called from torchgpipe itself, never copied).

Each returns ``stage sizes`` (layer counts of the K contiguous stages, in profile order).

torchgpipe's ``balance/blockpartition.py`` is plain Python, but importing it as
``torchgpipe.balance.blockpartition`` runs ``torchgpipe/__init__.py``, which imports torch (two
seconds, and the planner imports no torch): the file is loaded on its own instead.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autopipe.core.layer_costs import LayerCosts
from autopipe.errors import PartitionError
from autopipe.solvers.dp import check_stage_count, minmax_dp

__all__ = ["uniform_sizes", "params_sizes", "param_counts", "blockpartition_sizes", "sizes_to_assignment",
           "kept_whole"]


def uniform_sizes(n: int, k: int) -> list[int]:
    """Equal layer counts; the first ``n % k`` stages get one more layer."""
    check_stage_count(n, k)
    return [n // k + (1 if s < n % k else 0) for s in range(k)]


def params_sizes(param_bytes: Sequence[int], k: int) -> list[int]:
    """DeepSpeed's ``partition_method="parameters"``: contiguous stages with the smallest
    largest parameter total (an exact min-max split of the parameter counts)."""
    n = len(param_bytes)
    check_stage_count(n, k)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(param_bytes, dtype=np.float64))])
    rows = np.arange(n + 1)

    def cost(_: int, j0: int, j1: int) -> np.ndarray:
        cols = np.arange(j0, j1)
        return np.where(rows[:, None] < cols[None, :], prefix[None, j0:j1] - prefix[:, None], np.inf)

    _, starts = minmax_dp(n, k, cost)
    return [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]


def param_counts(costs: LayerCosts) -> list[int]:
    """Each layer's parameter bytes as DeepSpeed's balance counts them: a tied weight once, at
    its first use (the input of :func:`params_sizes`)."""
    counts = costs.params.copy()
    for members, nbytes in costs.tie_groups:
        counts[members[0]] += nbytes
    return [int(c) for c in np.asarray(counts)]


def blockpartition_sizes(costs: Sequence[float], k: int) -> list[int]:
    """torchgpipe's ``balance.blockpartition.solve`` on per-layer costs (needs torchgpipe)."""
    check_stage_count(len(costs), k)
    blocks = _blockpartition().solve(list(costs), partitions=k)
    return [len(b) for b in blocks]


@functools.cache
def _blockpartition() -> Any:
    """torchgpipe's balance/blockpartition.py, loaded without its package (which imports torch)."""
    package = importlib.util.find_spec("torchgpipe")
    path = Path(package.origin).parent / "balance" / "blockpartition.py" if package and package.origin else None
    if path is None or not path.is_file():
        raise PartitionError("method='blockpartition' calls torchgpipe's algorithm: pip install torchgpipe")
    spec = importlib.util.spec_from_file_location("autopipe_torchgpipe_blockpartition", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sizes_to_assignment(sizes: Sequence[int]) -> list[int]:
    return [s for s, size in enumerate(sizes) for _ in range(size)]


def kept_whole(sizes: Sequence[int], forbidden: Any, method: str) -> list[int]:
    """``sizes`` with each cut that falls inside a group kept together (``forbidden``, per cut
    position: LayerCosts.forbidden_cuts) moved to the nearer edge of the group, the earlier on a
    tie: a baseline's split the runtime can run; one line where no such move leaves every stage
    a layer."""
    n = len(forbidden) - 1
    cuts = list(np.cumsum(sizes)[:-1])
    for s, c in enumerate(cuts):
        if forbidden[c]:
            lo = c - 1
            while forbidden[lo]:
                lo -= 1
            hi = c + 1
            while hi < n and forbidden[hi]:
                hi += 1
            cuts[s] = lo if c - lo <= hi - c else hi
    bounds = [0, *cuts, n]
    if any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise PartitionError(f"method={method!r} cannot split {n} layers into {len(sizes)} stages without "
                             "cutting a TP group (or a tie group under ties='colocate'); use fewer stages or "
                             "method='exact'")
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
