"""Lower bounds on a pipeline's simulated iteration: what lets the search skip work exactly.

``config_bound`` holds for every split of a configuration (from the profile's totals),
``split_bound`` for one split (from its stage times), before anything is simulated; the search
([Note: automatic search] in autopipe/solvers/search.py) skips what cannot beat its best.
``pipeline_bound`` holds for every split under GPipe and 1F1B, from a path through each
stage's operations, and is what the step's descent states its gap against there
([Note: the step, not the bottleneck] in autopipe/solvers/step_split.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.cost_options import CostOptions

__all__ = ["config_bound", "pipeline_bound", "split_bound"]


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


def pipeline_bound(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> float | None:
    """No split of this configuration iterates faster under ``gpipe`` or ``1f1b`` (None under
    the others). Micro-batch 0's forwards through every stage, its backwards down to stage s, all
    of stage s's operations after its first backward, and micro-batch M-1's backwards below s are
    one path of the simulated step: with w = 1 under GPipe (stage s runs its forwards first) and
    w = min(M, K - s) warm-up forwards under 1F1B,

        T >= sum over stages of (F + B) + (M - 1) B_s + (M - w) F_s + R_s x recompute_s
             + the recomputation of micro-batch M-1 below s and of micro-batch 0 above s

    (F, B: a micro-batch's forward and backward with the stage call, transfers left out; R_s the
    micro-batches stage s recomputes, the last ones: micro-batch M-1 where any, 0 where all).
    The least over splits of the largest of these is a min-max over contiguous blocks with a cost
    of its own per stage, solved by a DP over (stage, last layer); the sum over stages is at least
    the layers' work on the fastest device, a recomputation at least its layers' on it."""
    if options.schedule not in ("gpipe", "1f1b"):
        return None
    k, m, n = len(devices), options.chunks, len(costs)
    call_f, call_b = costs.call_for(options.schedule)
    rec = options.recomputed(k)
    fast, ratio, rcall = max(d.speed for d in devices), costs.recompute_ratio, costs.recompute_call_ms
    pf = np.concatenate([[0.0], np.cumsum(costs.fwd, dtype=np.float64)])
    pb = np.concatenate([[0.0], np.cumsum(costs.bwd, dtype=np.float64)])
    best = np.full(n + 1, np.inf)  # the least largest term of stages 0..s over layers [0, e)
    best[0] = 0.0
    rows = np.arange(n + 1)[:, None]
    for s, dev in enumerate(devices):
        w = 1 if options.schedule == "gpipe" else min(m, k - s)
        a, b = (m - w + rec[s] * ratio) / dev.speed, (m - 1) / dev.speed
        below = ratio / fast if all(r >= 1 for r in rec[:s]) else 0.0  # micro-batch M-1 recomputed
        above = ratio / fast if all(r == m for r in rec[s + 1:]) else 0.0  # micro-batch 0 too
        fixed = ((m - 1) * call_b + (m - w) * call_f + rec[s] * rcall
                 + rcall * (s * (below > 0) + (k - 1 - s) * (above > 0)))
        nxt = np.full(n + 1, np.inf)
        for e0 in range(1, n + 1, 256):  # [i, e]: stage s holds layers [i, e), i < e
            e = np.arange(e0, min(e0 + 256, n + 1))
            term = (a * (pf[e] - pf[:, None]) + b * (pb[e] - pb[:, None]) + below * pf[:, None]
                    + above * (pf[n] - pf[e]) + fixed)
            nxt[e] = np.where(rows < e, np.maximum(best[:, None], term), np.inf).min(axis=0)
        best = nxt
    total = float(costs.fwd.sum() + costs.bwd.sum()) / fast + k * (call_f + call_b)
    return total + float(best[n])
