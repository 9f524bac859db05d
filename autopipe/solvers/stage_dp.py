"""Exact min-max split of the topological order, with a recompute mode chosen per stage.

[Note: per-stage mode DP] Stage costs are evaluated for every contiguous range ``layers[i:j]``
at once, in column blocks (numpy), with autopipe.core.cost's formulas. A stage may run any of its
allowed recompute modes; its cost is the fastest mode whose memory fits its device (inf when
none does), which is exact for the bottleneck: the stages of a split do not share memory, so
each picks its own mode, and a faster stage never raises the maximum. The DP runs over
SUFFIXES::

    best[r][i] = min over j > i of max(cost_r(layers i..j-1), best[r-1][j])

where r counts stages from the END of the pipeline. A stage's memory depends on its place only
through the schedule's in-flight micro-batches, and under 1F1B stage s of K holds
``min(M, K - s)`` of them: the count from the end, r. So on identical devices under ``gpipe`` or
``1f1b`` one pass to r = K_max answers every stage count K <= K_max (``best[K][0]``);
``solve_counts`` does that for the automatic search. Other cases (devices that differ,
``interleaved1f1b``, one fixed mode per stage) depend on K and run one pass per K
(``solve_split``). Blocks are cached per (mode, speed, limit, memory terms), so the passes of
one search share them. Ties between splits go to the shortest first stages (first argmin).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from autopipe.core.backward_memory import gather_level, range_extras
from autopipe.core.cost import (
    OPTIMIZER_FACTOR,
    STEP_TEMPORARIES,
    DeviceSpec,
    LayerCosts,
    Terms,
    activation_bytes,
    cast_cache_bytes,
    kept_activation_bytes,
    kept_bytes,
    layer_work,
    loss_grad_bytes,
    receive_bytes,
    received_walk,
    schedule_ranks,
    stage_fixed_ms,
    stage_terms,
    stage_time,
    state_bytes,
    step_bytes,
    weight_held_bytes,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.layer_costs import FloatArray
from autopipe.core.recomputed_layers import recomputed_outputs
from executor.spec import RECOMPUTE_MODES, ZERO_BUBBLE_SCHEDULES, recomputed_microbatches

__all__ = ["Split", "StageBlocks", "budget_devices", "solve_split", "solve_counts", "suffix_minmax"]

_BLOCK = 256  # columns per block: (rows <= N + 1) x 256 floats per array
_CACHE_LIMIT = 1 << 28  # bytes of cached blocks before the cache is cleared


@dataclass(frozen=True)
class Split:
    assignment: list[int]  # stage of each layer
    bottleneck: float  # ms
    modes: list[str]  # each stage's recompute mode


class StageBlocks:
    """Time and memory of every contiguous stage ``layers[i:j]`` (i < j), per recompute mode,
    for column blocks ``j0 <= j < j1`` and rows ``i < j1``; ``masked_time`` caches its blocks."""

    def __init__(self, costs: LayerCosts, options: CostOptions) -> None:
        n = len(costs)
        self.n, self.m, self.options = n, options.chunks, options
        self.ratio, self.call_ms = costs.recompute_ratio, costs.call_ms(options.schedule)
        self.recompute_call_ms = costs.recompute_call_ms
        self.latency_ms = costs.comm_latency_ms
        self.receive_share = costs.comm_receive_share
        zero = np.zeros(1)
        self.fwd = np.concatenate([zero, np.cumsum(costs.fwd)])
        self.bwd = np.concatenate([zero, np.cumsum(costs.bwd)])
        self.params = np.concatenate([zero, np.cumsum(costs.params.astype(np.float64))])
        self.buffers = np.concatenate([zero, np.cumsum(costs.buffers.astype(np.float64))])
        self.saved = np.concatenate([zero, np.cumsum(costs.saved.astype(np.float64))])
        grads = np.zeros(n) if costs.weight_grad is None else costs.weight_grad.astype(np.float64)
        self.weight_grad = np.concatenate([zero, np.cumsum(grads)])  # [Note: split backward time]
        self.cut = costs.cut_bytes().astype(np.float64)
        self.resaved_cut = costs.resaved_cut().astype(np.float64)  # [Note: saved once]
        self.input_saved = costs.input_saved_cut().astype(np.float64)  # [Note: an input kept once]
        self.ties = costs.tie_groups
        self.precision = costs.precision  # [Note: mixed precision memory]
        self.loss_grads = loss_grad_bytes(costs, options.chunks)  # [Note: the loss's memory]
        self.costs = costs
        self.forbidden = costs.forbidden_cuts(options.ties)  # cut positions inside a group kept together
        self._cache: dict[tuple[object, ...], Any] = {}  # numpy blocks
        self._cached_bytes = 0

    def _store(self, key: tuple[object, ...], value: Any) -> Any:
        if self._cached_bytes + value.nbytes > _CACHE_LIMIT:
            self._cache.clear()
            self._cached_bytes = 0
        self._cache[key] = value
        self._cached_bytes += value.nbytes
        return value

    def _cached(self, key: tuple[object, ...], make: Callable[[], Any]) -> Any:
        return self._cache[key] if key in self._cache else self._store(key, make())

    def valid(self, j0: int, j1: int) -> npt.NDArray[np.bool_]:
        """(j1, j1-j0) mask of ranges i < j that do not cut a colocated tie group."""
        def make() -> npt.NDArray[np.bool_]:
            cols = np.arange(j0, j1)
            rows = np.arange(j1)
            ok = rows[:, None] < cols[None, :]
            ok &= ~self.forbidden[:j1, None]
            ok &= ~(self.forbidden[cols] & (cols < self.n))[None, :]
            return ok
        out: npt.NDArray[np.bool_] = self._cached(("valid", j0), make)
        return out

    def time(self, j0: int, j1: int, recomputed: int, speed: float) -> FloatArray:
        return self._cached(("stage time", j0, recomputed, speed), lambda: self._time(j0, j1, recomputed, speed))

    def _time(self, j0: int, j1: int, recomputed: int, speed: float) -> FloatArray:
        f, b, cut = self.fwd, self.bwd, self.cut
        work = self._cached(("work", j0, recomputed), lambda: layer_work(
            f[None, j0:j1] - f[:j1, None], b[None, j0:j1] - b[:j1, None], recomputed, self.m,
            self.ratio))
        xfer = self._cached(("xfer", j0), lambda: stage_time(
            0.0, 1.0, cut[:j1, None], cut[None, j0:j1], self.options.ms_per_byte, self.call_ms,
            self.latency_ms, self.receive_share))
        fixed = stage_fixed_ms(0.0, self.recompute_call_ms, recomputed, self.m)
        out: FloatArray = work / speed + xfer + fixed  # cost.stage_time, transfers + call cost cached
        return out

    def param_bytes(self, j0: int, j1: int) -> FloatArray:
        """Parameter bytes of every range (tied groups included)."""
        def make() -> FloatArray:
            p = self.params
            params: FloatArray = p[None, j0:j1] - p[:j1, None]
            cols, rows = np.arange(j0, j1), np.arange(j1)
            for members, nbytes in self.ties:
                idx = np.asarray(members)
                # largest member index below j (or -1): the range [i, j) holds a member iff it is >= i
                pos = np.searchsorted(idx, cols, side="left") - 1
                last = np.where(pos >= 0, idx[np.maximum(pos, 0)], -1)
                params = params + nbytes * (rows[:, None] <= last[None, :])
            return params
        out: FloatArray = self._cached(("params", j0), make)
        return out

    def state(self, j0: int, j1: int) -> FloatArray:
        """Parameters with optimizer state and buffers of every range (tied groups included)."""
        b = self.buffers
        out: FloatArray = self._cached(("state", j0), lambda: state_bytes(
            self.param_bytes(j0, j1), b[None, j0:j1] - b[:j1, None], self.options.optimizer,
            self.options.data_parallel, self.options.dp_mode))
        return out

    def memory(self, j0: int, j1: int, terms: Terms, recomputed: int,
               ends: tuple[bool, bool] = (False, False)) -> FloatArray:
        """Peak memory of every range as a stage with these ``terms``; ``ends``: whether it is
        the first and the last stage (what it holds from a split backward's I to its W)."""
        split = any(t[2] for t in terms)
        ends = ends if split else (False, False)

        saved = self._cached(("saved", j0), lambda: self.saved[None, j0:j1] - self.saved[:j1, None]
                             + self.resaved_cut[:j1, None])
        ranks = self.costs.runtime == "distributed"  # [Note: receive buffers] in stage_memory.py
        held = self._cached(("held", j0, ends), lambda: weight_held_bytes(
            self.weight_grad[None, j0:j1] - self.weight_grad[:j1, None], self.cut[None, j0:j1],
            *ends, ranks)) if split else 0
        cols = np.arange(j0, j1)
        last = cols == self.n  # the column j = n: the last stage ([Note: the loss's memory])
        cut_out = self.cut[np.minimum(cols, self.n)]
        kept = kept_bytes(self.costs, cut_out[None, :], last[None, :], self.costs.received_before(np.arange(j1)[:, None]))
        grads = np.where(last, self.loss_grads, 0)[None, :]
        cut_in, saved, input_saved = received_walk(ranks, self.cut[:j1, None], saved,
                                                   np.minimum(self.input_saved[:j1, None], saved))
        o = self.options  # [Note: the backward's memory]
        extras = range_extras(self.costs, self.param_bytes(j0, j1), j0, j1, j1, OPTIMIZER_FACTOR[o.optimizer],
                              o.data_parallel, o.dp_mode, o.schedule, o.chunks, self.cut[:j1, None] if ranks else 0)
        out: FloatArray = (  # a new array; most blocks keep nothing and take the plain walk
            kept_activation_bytes(cut_in, saved, terms, held, input_saved, kept, grads, extras)
            if kept.any() or grads.any() or extras is not None
            else activation_bytes(cut_in, saved, terms, held, input_saved))
        if extras is not None and last.any() and self.costs.runtime == "gpipe":  # the gathered outputs
            gather = gather_level(self.costs, o.chunks, cut_in, saved, terms, held, input_saved, extras)
            out[:, last] = np.maximum(out[:, last], gather[:, last])
        out += recomputed_outputs(cut_out[None, :], last[None, :], recomputed)
        optimizer = self.options.optimizer
        if optimizer in STEP_TEMPORARIES:  # [Note: the optimizer step's memory]
            one = self.costs.one_at_a_time
            step = self._cached(("step", j0), lambda: step_bytes(
                self.param_bytes(j0, j1), self.costs.largest_params(j0, j1, j1) if one else 0, optimizer, one,
                self.options.data_parallel, self.options.dp_mode))
            np.maximum(out, step, out=out)
        out += self.state(j0, j1)
        if ranks:
            out += receive_bytes(self.costs, self.cut[:j1, None], cut_out[None, :], o.chunks)
        if self.precision != "fp32" and recomputed:
            out += cast_cache_bytes(self.param_bytes(j0, j1), self.precision, recomputed)
        return out  # not cached: each is read once per pass, through masked_time's cache

    def masked_time(self, j0: int, j1: int, recomputed: int, speed: float, limit: int | None,
                    terms: Terms, ends: tuple[bool, bool] = (False, False)) -> FloatArray:
        """Stage time where the range is a valid stage that fits ``limit``, else inf."""
        key = ("time", j0, recomputed, speed, limit, (terms, ends) if limit is not None else None)
        if key in self._cache:
            return self._cache[key]
        ok = self.valid(j0, j1)  # cached: never changed in place
        if limit is not None:
            ok = ok & (self.memory(j0, j1, terms, recomputed, ends) <= limit)
        out: FloatArray = np.where(ok, self.time(j0, j1, recomputed, speed), np.inf)
        return self._store(key, out)


def budget_devices(devices: Sequence[DeviceSpec], schedule: str) -> list[DeviceSpec]:
    """The devices the DP bounds each stage by. [Note: interleaved memory] Under a schedule of
    several stages per rank (``interleaved1f1b``, ``interleaved_zb``, the V of ``zbv`` and
    ``dualpipev``) a rank holds V stages at once and its peak is not any one stage's; the
    DP gives each of them 1/V of the rank's memory. The sum of the stages' own peaks bounds
    the rank's peak, so a split that the DP accepts always fits (the simulator reports the
    rank's exact peak, ``device_memory``), at the price of refusing some that would."""
    ranks = schedule_ranks(schedule, devices)
    if ranks is None:
        return list(devices)
    per_rank = len(devices) // ranks
    return [DeviceSpec(d.name, None if d.memory is None else d.memory // per_rank, d.speed)
            for d in devices]


BlockCost = Callable[[int, int, int], FloatArray]  # (stage r from the end, j0, j1) -> (j1, j1-j0)


def suffix_minmax(n: int, r_max: int, cost: BlockCost) -> tuple[FloatArray, np.ndarray]:
    """``best[r][i]``: the least max stage cost of layers ``i..n-1`` in r stages; ``choice[r][i]``
    the end of the first of them. See [Note: per-stage mode DP]."""
    best = np.full((r_max + 1, n + 1), np.inf)
    best[0, n] = 0.0
    choice = np.zeros((r_max + 1, n + 1), dtype=np.int64)
    for r in range(1, r_max + 1):
        new, arg = best[r], choice[r]
        for j0 in range(1, n + 1, _BLOCK):
            j1 = min(j0 + _BLOCK, n + 1)
            if not np.isfinite(best[r - 1, j0:j1]).any():
                continue
            cand = np.maximum(cost(r, j0, j1), best[r - 1, None, j0:j1])
            a = np.argmin(cand, axis=1)
            v = cand[np.arange(j1), a]
            better = v < new[:j1]
            new[:j1] = np.where(better, v, new[:j1])
            arg[:j1] = np.where(better, a + j0, arg[:j1])
    return best, choice


def _trace(n: int, k: int, choice: np.ndarray) -> list[tuple[int, int]]:
    ranges, i = [], 0
    for r in range(k, 0, -1):
        j = int(choice[r, i])
        ranges.append((i, j))
        i = j
    assert i == n, "a finite DP value traces back to a full split"
    return ranges


class _Stage:
    """Cost of a stage r from the end of a K-stage pipeline, over its allowed modes."""

    def __init__(self, blocks: StageBlocks, options: CostOptions, ranks: int | None) -> None:
        self.blocks, self.options, self.ranks = blocks, options, ranks

    def mode_costs(self, s: int, k: int, device: DeviceSpec, modes: Sequence[str],
                   j0: int, j1: int) -> list[FloatArray]:
        m = self.options.chunks
        out = []
        for mode in modes:
            rec = recomputed_microbatches(mode, m)
            terms = stage_terms(self.options.schedule, s, k, m, rec, self.ranks, self.options.merge)
            out.append(self.blocks.masked_time(j0, j1, rec, device.speed, device.memory, terms,
                                               self.ends(s, k)))
        return out

    def ends(self, s: int, k: int) -> tuple[bool, bool]:
        """Whether stage s of k is the first and the last, where its memory depends on it (what
        a split backward holds from I to W: [Note: split backward time] in cost.py)."""
        return (s == 0, s == k - 1) if self.options.schedule in ZERO_BUBBLE_SCHEDULES else (False, False)

    def cost(self, s: int, k: int, device: DeviceSpec, modes: Sequence[str], j0: int, j1: int) -> FloatArray:
        if len(modes) == 1:
            return self.mode_costs(s, k, device, modes, j0, j1)[0]
        m = self.options.chunks
        key = ("fastest", j0, device.speed, device.memory, tuple(modes), (tuple(
            stage_terms(self.options.schedule, s, k, m, recomputed_microbatches(mode, m), self.ranks,
                        self.options.merge)
            for mode in modes), self.ends(s, k)) if device.memory is not None else None)
        if key not in self.blocks._cache:
            best: FloatArray = np.minimum.reduce(self.mode_costs(s, k, device, modes, j0, j1))
            self.blocks._store(key, best)
        return self.blocks._cache[key]

    def split(self, n: int, k: int, choice: np.ndarray, value: float, devices: Sequence[DeviceSpec],
              allowed: Sequence[Sequence[str]]) -> Split:
        assignment = [0] * n
        modes = []
        for s, (i, j) in enumerate(_trace(n, k, choice)):
            assignment[i:j] = [s] * (j - i)
            j0 = 1 + (j - 1) // _BLOCK * _BLOCK
            j1 = min(j0 + _BLOCK, n + 1)
            times = [float(c[i, j - j0]) for c in self.mode_costs(s, k, devices[s], allowed[s], j0, j1)]
            modes.append(allowed[s][int(np.argmin(times))])
        return Split(assignment, value, modes)


def _allowed(options: CostOptions, k: int, modes: str | Sequence[str] | None) -> list[list[str]]:
    """Each stage's allowed modes: "auto" -> all; None -> the options' own; else the given."""
    if modes == "auto":
        return [list(RECOMPUTE_MODES)] * k
    fixed = options if modes is None else replace(options, recompute=modes)
    return [[mode] for mode in fixed.modes(k)]


def solve_split(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions, *,
                modes: str | Sequence[str] | None = None, blocks: StageBlocks | None = None) -> Split | None:
    """The best split into ``len(devices)`` stages (stage s on ``devices[s]``, whose ``memory``
    bounds the stage); ``modes``: "auto" lets each stage pick its mode, a mode or list fixes
    them (default: the options'). None when no split fits."""
    n, k = len(costs), len(devices)
    blocks = blocks or StageBlocks(costs, options)
    stage = _Stage(blocks, options, schedule_ranks(options.schedule, devices))
    allowed = _allowed(options, k, modes)
    best, choice = suffix_minmax(n, k, lambda r, j0, j1: stage.cost(
        k - r, k, devices[k - r], allowed[k - r], j0, j1))
    value = float(best[k, 0])
    return stage.split(n, k, choice, value, devices, allowed) if np.isfinite(value) else None


def solve_counts(costs: LayerCosts, device: DeviceSpec, options: CostOptions, k_max: int, *,
                 modes: str = "auto", blocks: StageBlocks | None = None) -> dict[int, Split | None]:
    """The best split for every stage count 1..k_max on identical ``device``s, in one pass
    ([Note: per-stage mode DP]); ``gpipe`` and ``1f1b`` only. ``modes``: "auto" or one mode."""
    if options.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"solve_counts needs a schedule whose memory depends on the count from "
                         f"the end only (gpipe, 1f1b), not {options.schedule!r}")
    n = len(costs)
    k_max = min(k_max, n)
    blocks = blocks or StageBlocks(costs, options)
    stage = _Stage(blocks, options, None)
    allowed = list(RECOMPUTE_MODES) if modes == "auto" else [modes]
    # stage s = K - r of any K: its 1F1B in-flight count min(M, r) is that of stage k_max - r of k_max
    best, choice = suffix_minmax(n, k_max, lambda r, j0, j1: stage.cost(
        k_max - r, k_max, device, allowed, j0, j1))
    out: dict[int, Split | None] = {}
    for k in range(1, k_max + 1):
        value = float(best[k, 0])
        if not np.isfinite(value):
            out[k] = None
            continue
        out[k] = stage.split(n, k, choice, value, [device] * k, [allowed] * k)
    return out
