"""Recomputing chosen layers inside a stage: what each run of them frees and what it costs.

[Note: recomputed layers] A stage's recompute mode recomputes a whole stage for some
micro-batches ([Note: per-stage recomputation] in executor/spec.py). Finer: a stage that
never recomputes as a whole can still drop, after every forward, what some of its layers save
for backward and recompute them in the backward, those whose saves are large for their forward
time. ``Plan.recompute_layers`` names them; only a stage in mode ``never`` may have any (a stage
checkpointed as a whole recomputes them anyway). Layers next to each other in the profile's
order and in the same stage form one SEGMENT, unless ``Plan.segment_starts`` names a layer
that starts a segment of its own (two blocks recomputed apart: only one of them is alive again
at a time in the backward, where merged they would be alive together): one
``torch.utils.checkpoint`` around all of a segment's layers (reentrant, as executor.GPipe's own; an empty anchor tensor that needs a gradient among
its inputs lets it reach the parameters of a segment fed by the caller's batch), built by
autopipe/frontend/building/stages.py, which runs the segment on copies of its inputs (a later in-place
op on one, an in-place ReLU after a residual add, must not change what the backward recomputes
from).

For a segment G, in the terms of [Note: saved once] (autopipe/core/layer_costs.py):

- held before: ``sum(saved[G])``, its layers' saves net of what their producers save too;
- held after: the copy of the values entering G from earlier layers (of each producer outside
  G, the most one layer of G reads of it: [Note: what a consumer reads] in layer_costs.py; the
  caller's batch is not counted), and G's outputs where a consumer
  outside G saves them too (``resaved``: G no longer does, the consumer still does);
- so it frees ``segment_freed`` = before - after per micro-batch held (never below 0): a
  single Linear, which saves its input, frees nothing, but ``fc1 -> gelu -> fc2`` frees all its
  hidden activations for one copy of its input;
- and its backward runs its forward again first: ``recompute_alone_ms`` = ``sum(fwd[G]) x
  recompute_ratio + recompute_call_ms`` per micro-batch, the profile's measured ratio and the
  fixed cost of a checkpoint call ([Note: measured overheads] in cost.py). The copies are
  not charged as time: a plan run without them took the same time. Measured:
  docs/benchmarks.md, "The automatic plan, run" (cnn's plan recomputes a 9-layer segment);
  the A/B runs behind this Note are in CHANGELOG.md ("Recomputed segments fed by the caller's
  batch use the reentrant checkpoint", "Layers recomputed alone, then segments").

``stage_costs`` (cost.py) subtracts each segment's freed bytes from its stage's ``saved_bytes``
and adds its time to the stage's backward, for every micro-batch. While a segment recomputes,
its saves live again for that micro-batch, after the backward of the stage's later layers freed
theirs: :func:`recompute_peak` adds the largest ``sum(saved[G]) - sum(saved[later layers not
recomputed])`` (at least 0) to the stage's peak once (counted to the byte by
executor.ActivationMeter in tests/frontend/building/test_recompute_alone.py). Beside them, torch's
reentrant checkpoint holds what it recomputed as the segment's outputs and their gradients until
the segment's backward returns (``CheckpointFunction.backward``), where a plain backward frees
each once its layer is done: :func:`segment_outputs`, an output that a layer of the segment saves
counted once (its value is among the saves). ``StageCost.recompute_outputs_bytes`` keeps it apart:
in the peak, not in the saves ActivationMeter counts (measured against live tensor bytes on 2
ranks: tests/test_benchmark_step_memory.py). A stage recomputed whole (executor/recompute.py's
checkpoint) holds the same, its recomputed outputs, in a recomputed micro-batch's backward
(:func:`recomputed_outputs`; its output's gradient is in the runtime's receive buffer), but on
the last stage, where the loss's backward has freed them before the stage's starts (measured:
charging them there predicted the last rank 13-16% high). Every solver charges it with the
stage's activations. :func:`choose_segments` picks the
segments of one stage that free at least the bytes asked for at the least time: a DP over the
stage's layers in order for ``time - lambda x bytes`` (a Lagrangian relaxation), lambda
bisected; segments are at most ``MAX_SEGMENT`` layers, and two it picks that touch stay two
(:func:`choose_segments`; the plan's ``segment_starts``), as it weighed them. The planner applies it after the split
(autopipe/solvers/layer_recompute.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from autopipe.core.layer_costs import LayerCosts
from autopipe.core.transfer import Amount
from autopipe.errors import PartitionError

__all__ = ["MAX_SEGMENT", "choose_segments", "recompute_alone_ms", "recompute_peak",
           "recomputed_outputs", "recomputed_runs", "segment_freed", "segment_outputs", "segments"]

MAX_SEGMENT = 64  # layers in one recomputed segment, at most, when choosing
_BISECTIONS = 40


def recompute_alone_ms(fwd: Amount, count: Amount, ratio: float, call_ms: float, speed: float = 1.0) -> Amount:
    """What ``count`` segments of forward ``fwd`` (their sum) add to a backward per micro-batch
    on a device of relative ``speed``: the forward again x the measured ratio, and each
    checkpoint's call (host time, not scaled)."""
    return fwd * ratio / speed + count * call_ms


def segments(chosen: Sequence[int], stage: Sequence[int], starts: Collection[int] = ()) -> list[list[int]]:
    """``chosen`` layer indices as runs of consecutive indices in one stage (``stage[i]``), a new
    run at each index of ``starts`` ([Note: recomputed layers])."""
    runs: list[list[int]] = []
    for i in sorted(chosen):
        if runs and runs[-1][-1] == i - 1 and stage[i - 1] == stage[i] and i not in starts:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def recomputed_runs(costs: LayerCosts, stage: np.ndarray, modes: Sequence[str], names: Sequence[str],
                    starts: Sequence[str] = ()) -> tuple[np.ndarray, list[list[int]]]:
    """Which layers are recomputed alone, and their segments ([Note: recomputed layers]);
    PartitionError for a name the profile lacks, one in a stage that recomputes as a whole, or a
    segment start that is not recomputed."""
    mask = np.zeros(len(costs), dtype=bool)
    index = {name: i for i, name in enumerate(costs.names)}
    for name in names:
        if name not in index:
            raise PartitionError(f"recompute_layers names {name!r}, which is not a layer of the profile")
        s = int(stage[index[name]])
        if modes[s] != "never":
            raise PartitionError(f"layer {name!r} is recomputed alone but its stage {s} recomputes as a whole "
                                 f"(recompute {modes[s]!r}); recompute layers only in stages whose mode "
                                 "is 'never'")
        mask[index[name]] = True
    apart = {index.get(name, -1) for name in starts}
    if any(i < 0 or not mask[i] for i in apart):
        wrong = next(n for n in starts if n not in index or not mask[index[n]])
        raise PartitionError(f"segment_starts names {wrong!r}, which is not among recompute_layers; "
                             "name only recomputed layers, each the first of its segment")
    return mask, segments(np.flatnonzero(mask).tolist(), stage.tolist(), apart)


def recompute_peak(costs: LayerCosts, runs: Sequence[Sequence[int]], kept: Sequence[int]) -> tuple[int, int]:
    """What one stage's recomputation adds to its peak: the largest segment of ``runs`` alive
    again, less the saves of the stage's layers ``kept`` (not recomputed) after it, which their
    backward freed first; and what the largest with its held outputs (:func:`segment_outputs`)
    adds to that ([Note: recomputed layers])."""
    later = np.asarray(kept, dtype=np.int64)
    again = [max(int(costs.saved[list(r)].sum()) - int(costs.saved[later[later > r[-1]]].sum()), 0) for r in runs]
    most = max(again, default=0)
    return most, max((a + segment_outputs(costs, r) for a, r in zip(again, runs, strict=True)), default=0) - most


def segment_outputs(costs: LayerCosts, run: Sequence[int]) -> int:
    """What torch's reentrant checkpoint holds beside a segment's saves while it back-propagates
    it: the recomputed outputs (those no layer of the segment saves as its input) and every output's gradient,
    alive until the segment's backward returns ([Note: recomputed layers])."""
    inside = set(run)
    outputs = [u for u in run if any(c not in inside for c in costs.consumers[u])]
    saved_inside = {u for u in outputs if any(c in inside and costs.saved_input[c] > 0 for c in costs.consumers[u])}
    return sum(int(costs.value_bytes[u]) * (1 if u in saved_inside else 2) for u in outputs)


def recomputed_outputs(cut_out: Amount, last: Amount, recomputed: int) -> Amount:
    """What a stage that recomputes whole micro-batches (``recomputed`` of them) holds beside the
    saves while it back-propagates one: the outputs its checkpoint recomputed (``cut_out``); none
    on the ``last`` stage, whose loss's backward frees them first ([Note: recomputed layers])."""
    if not recomputed:
        return 0
    return np.where(last, 0, cut_out) if isinstance(last, np.ndarray) else (0 if last else cut_out)


def segment_freed(costs: LayerCosts, segment: Sequence[int]) -> int:
    """Bytes per held micro-batch a segment (consecutive layer indices) frees when recomputed."""
    lo, hi = segment[0], segment[-1]
    kept = sum(max((b for c, b in costs.reads(p) if lo <= c <= hi), default=0) for p in range(lo))
    leaving = sum(int(costs.resaved[u]) for u in segment if int(costs.last_saver[u]) > hi)
    return max(int(costs.saved[lo:hi + 1].sum()) - kept - leaving, 0)


def _intervals(costs: LayerCosts, layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every run of up to MAX_SEGMENT consecutive ``layers`` that frees bytes and holds each TP
    group whole or not at all: (start, end) positions in ``layers`` and (freed bytes, extra ms)
    each."""
    producers: dict[int, list[tuple[int, int]]] = {}  # layer -> (producer, what it reads of it)
    ending: dict[int, list[int]] = {}  # layer -> the layers whose last saving consumer it is
    for u in range(len(costs)):
        for c, b in costs.reads(u):
            producers.setdefault(c, []).append((u, b))
        ending.setdefault(int(costs.last_saver[u]), []).append(u)
    inside = costs.forbidden_cuts("share")  # a TP group's split values never cross a segment's edge
    no_start, no_end = inside[:-1], inside[1:]
    out: list[tuple[int, int, int, float]] = []
    for a, first in enumerate(layers):
        if no_start[first]:
            continue
        entering: dict[int, int] = {}  # [Note: what a consumer reads]: the most read of each
        saved = kept = leaving = 0
        fwd = 0.0
        for b in range(a, min(len(layers), a + MAX_SEGMENT)):
            i = layers[b]
            if i != first + (b - a):
                break  # not consecutive: a segment cannot span it
            saved += int(costs.saved[i])
            fwd += float(costs.fwd[i])
            for p, read in producers.get(i, []):
                if p < first and read > entering.get(p, 0):
                    kept += read - entering.get(p, 0)
                    entering[p] = read
            if int(costs.last_saver[i]) > i:
                leaving += int(costs.resaved[i])
            leaving -= sum(int(costs.resaved[u]) for u in ending.get(i, []) if first <= u < i)
            freed = saved - kept - leaving
            if freed > 0 and not no_end[i]:
                out.append((a, b, freed, float(recompute_alone_ms(fwd, 1, costs.recompute_ratio,
                                                                  costs.recompute_call_ms))))
    table = np.array(out, dtype=np.float64).reshape(-1, 4)
    return table[:, 0].astype(np.int64), table[:, 1].astype(np.int64), table[:, 2], table[:, 3]


def _best(starts: np.ndarray, by_end: Sequence[np.ndarray], freed: np.ndarray, extra: np.ndarray,
          lam: float) -> list[int]:
    """Disjoint intervals minimising sum(extra - lam x freed) (``by_end[b]``: the intervals
    ending at position b): the indices of those chosen."""
    n = len(by_end)
    best = np.zeros(n + 1)
    pick = np.full(n + 1, -1, dtype=np.int64)
    for b in range(n):
        best[b + 1], pick[b + 1] = best[b], -1
        here = by_end[b]
        if here.size:
            values = best[starts[here]] + extra[here] - lam * freed[here]
            k = int(np.argmin(values))
            if values[k] < best[b + 1]:
                best[b + 1], pick[b + 1] = values[k], here[k]
    chosen, b = [], n
    while b > 0:
        if pick[b] < 0:
            b -= 1
        else:
            chosen.append(int(pick[b]))
            b = int(starts[pick[b]])
    return chosen


def choose_segments(costs: LayerCosts, layers: Sequence[int], need_bytes: float) -> list[list[int]]:
    """Of ``layers`` (one stage's indices), the segments to recompute, freeing at least
    ``need_bytes`` per held micro-batch at the least added time, in order, each apart from the
    next even where they touch ([Note: recomputed layers]); [] when ``need_bytes <= 0``; the
    most bytes any choice frees when nothing frees enough."""
    if need_bytes <= 0:
        return []
    layers = sorted(layers)
    starts, ends, freed, extra = _intervals(costs, layers)
    if not freed.size:
        return []

    by_end = [np.flatnonzero(ends == b) for b in range(len(layers))]

    def solve(lam: float) -> tuple[list[int], float]:
        chosen = _best(starts, by_end, freed, extra, lam)
        return chosen, float(freed[chosen].sum())

    high = float(extra.max() / freed.min()) * 2 + 1.0  # every useful interval pays at this price
    picked, got = solve(high)
    if got >= need_bytes:
        low, short = 0.0, []
        for _ in range(_BISECTIONS):
            mid = (low + high) / 2
            trial, amount = solve(mid)
            if amount >= need_bytes:
                high, picked = mid, trial
            else:
                low, short = mid, trial
        # the relaxation can overshoot a knapsack by a whole interval: also weigh the cheapest
        # single interval that frees enough, and the best choice just short plus one more
        alone = np.flatnonzero(freed >= need_bytes)
        options = [picked] + ([[int(alone[np.argmin(extra[alone])])]] if alone.size else [])
        apart = np.ones(freed.size, dtype=bool)
        for j in short:
            apart &= (ends < starts[j]) | (starts > ends[j])
        more = np.flatnonzero(apart & (freed >= need_bytes - freed[short].sum()))
        if more.size:
            options.append([*short, int(more[np.argmin(extra[more])])])
        picked = min(options, key=lambda ks: float(extra[ks].sum()))
    return sorted([layers[p] for p in range(int(starts[k]), int(ends[k]) + 1)] for k in picked)
