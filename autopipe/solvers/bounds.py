"""Lower bounds on a pipeline's simulated iteration: what lets the search skip work exactly.

``config_bound`` holds for every split of a configuration (from the profile's totals),
``split_bound`` for one split (from its stage times), before anything is simulated; the search
([Note: automatic search] in autopipe/solvers/search.py) skips what cannot beat its best.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopipe.core.cost import LayerCosts

__all__ = ["config_bound", "split_bound"]


def config_bound(schedule: str, costs: LayerCosts, speeds: Sequence[float], m: int) -> float:
    """No split of this configuration iterates faster (recomputation and transfers only add).

    Every stage runs M micro-batches, so the busiest device works at least M x (work / total
    speed) and M x the largest layer; one micro-batch crosses the whole pipeline (all work /
    fastest device). GPipe runs every forward before any backward: two flow shops in a row,
    each at least sum + (M - 1) x max of its stage times. Under gpipe and 1f1b stage s starts
    after micro-batch 0's forwards before it and ends before the last backwards before it:
    ``T >= sum(t[:s]) + M t[s]`` for every s (``split_bound``), and no split of work W into K
    stages gets all of these below ``W / (1 - (1 - 1/M)^K)`` (they are all equal there)."""
    fast, total, k = max(speeds), sum(speeds), len(speeds)
    f, b = costs.fwd, costs.bwd
    path = float(f.sum() + b.sum()) / fast
    busy = max(float((f + b).sum()) / total, float((f + b).max(initial=0.0)) / fast)
    bound = max(m * busy, path)
    if schedule in ("gpipe", "1f1b"):
        bound = max(bound, path / (1.0 - (1.0 - 1.0 / m) ** k))
    if schedule == "gpipe":
        per_f = max(float(f.sum()) / total, float(f.max(initial=0.0)) / fast)
        per_b = max(float(b.sum()) / total, float(b.max(initial=0.0)) / fast)
        bound = max(bound, path + (m - 1) * (per_f + per_b))
    return bound


def split_bound(schedule: str, times: Sequence[float], m: int, ranks: int) -> float:
    """A split's iteration is at least M x the work of its busiest device (``ranks`` take the
    stages in turn), and under gpipe and 1f1b at least ``sum(t[:s]) + M t[s]`` for every stage
    s (see ``config_bound``)."""
    bound = m * max(sum(times[r::ranks]) for r in range(ranks))
    if schedule in ("gpipe", "1f1b"):
        before = 0.0
        for t in times:
            bound = max(bound, before + m * t)
            before += t
    return bound
