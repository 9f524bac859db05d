"""Exact min-max partition of layers, in their topological order, into K contiguous stages.

``solve_dp`` minimises the bottleneck stage time (autopipe.core.cost's ``stage_time``: compute /
device speed + transfers at the stage's cuts) subject to each device's memory limit, tie groups and
non-empty stages, with the recompute mode(s) of its options. It is the classic O(K N^2) dynamic
program, run by autopipe.solvers.stage_dp ([Note: per-stage mode DP]) with every (i, j) column
block evaluated at once in numpy, so thousands of layers into 16 stages take about a second
(docs/benchmarks.md, "Solve time").
Stage costs are not monotone in the stage's extent (cutting through a wide activation costs more
than cutting next to it), so the shortcut of a binary search with a greedy feasibility test
would not be exact; the DP is. When no split fits, ``memory_error`` says why in one line, with
the fix that applies; its hints (fewest stages, another mode) use the first stage's memory
terms, exact for ``gpipe`` and the most a stage holds under ``1f1b``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

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
from autopipe.core.units import format_bytes
from autopipe.errors import PartitionError
from autopipe.solvers.search_space import stages_per_rank
from autopipe.solvers.stage_dp import solve_split
from executor.spec import MULTI_STAGE_SCHEDULES, V_SCHEDULES, recomputed_microbatches

__all__ = ["DPResult", "solve_dp", "RangeCosts"]

_BLOCK = 256  # columns per numpy block: bounds memory to (N + 1) x 256 floats per array


@dataclass(frozen=True)
class DPResult:
    assignment: list[int]  # stage of each layer
    bottleneck: float  # ms
    modes: list[str] = field(default_factory=list)  # each stage's recompute mode


def first_stage_terms(options: CostOptions, k: int, mode: str | None = None) -> Terms:
    """Memory terms of stage 0 of ``k`` (the most a stage holds under 1F1B) in ``mode`` (default:
    the options' first stage's)."""
    mode = options.modes(k)[0] if mode is None else mode
    ranks = (k // 2 if options.schedule in V_SCHEDULES else k) if options.schedule in MULTI_STAGE_SCHEDULES else None
    return stage_terms(options.schedule, 0, k, options.chunks,
                       recomputed_microbatches(mode, options.chunks), ranks, options.merge)


class RangeCosts:
    """Time and memory of a contiguous stage ``layers[i:j]`` for whole blocks of (i, j), in one
    checkpoint ``mode`` with one set of memory ``terms`` (for the messages of memory_error)."""

    def __init__(self, costs: LayerCosts, options: CostOptions, mode: str, terms: Terms) -> None:
        n = len(costs)
        self.n = n
        self.names = costs.names
        m = options.chunks
        rec_n = recomputed_microbatches(mode, m)
        self.terms = terms
        zero = np.zeros(1)
        work = layer_work(costs.fwd, costs.bwd, rec_n, m, costs.recompute_ratio)
        self.call_ms = stage_fixed_ms(costs.call_ms(options.schedule), costs.recompute_call_ms, rec_n, m)
        self.latency_ms = costs.comm_latency_ms
        self.receive_share = costs.comm_receive_share
        self.compute = np.concatenate([zero, np.cumsum(work)])
        self.cut = costs.cut_bytes().astype(np.float64)
        self.resaved_cut = costs.resaved_cut().astype(np.float64)  # [Note: saved once]
        self.input_saved = costs.input_saved_cut().astype(np.float64)  # [Note: an input kept once]
        self.ms_per_byte = options.ms_per_byte
        self.optimizer = options.optimizer
        self.replicas = (options.data_parallel, options.dp_mode)  # [Note: pipeline x data parallel]
        self.params = np.concatenate([zero, np.cumsum(costs.params.astype(np.float64))])
        self.buffers = np.concatenate([zero, np.cumsum(costs.buffers.astype(np.float64))])
        self.saved = np.concatenate([zero, np.cumsum(costs.saved.astype(np.float64))])
        grads = np.zeros(n) if costs.weight_grad is None else costs.weight_grad.astype(np.float64)
        self.weight_grad = np.concatenate([zero, np.cumsum(grads)])  # as the first stage holds it
        self.rec_n, self.m = rec_n, m
        self.precision = costs.precision  # [Note: mixed precision memory]
        self.ties = costs.tie_groups
        self.loss_grads = loss_grad_bytes(costs, m)  # [Note: the loss's memory]
        self.costs = costs
        self.schedule = options.schedule
        self.rows = np.arange(n + 1)
        self.forbidden = costs.forbidden_cuts(options.ties)  # cut positions inside a group kept together

    def valid(self, j0: int, j1: int) -> np.ndarray:
        """(n+1, j1-j0) mask of ranges i < j that do not cut a colocated tie group."""
        cols = np.arange(j0, j1)
        ok = self.rows[:, None] < cols[None, :]
        ok &= ~self.forbidden[:, None]
        ok &= ~(self.forbidden[cols] & (cols < self.n))[None, :]
        return ok

    def time(self, j0: int, j1: int, speed: float) -> FloatArray:
        c, cut = self.compute, self.cut
        out: FloatArray = stage_time(c[None, j0:j1] - c[:, None], speed, cut[:, None],
                                     cut[None, j0:j1], self.ms_per_byte, self.call_ms, self.latency_ms,
                                     self.receive_share)
        return out

    def memory(self, j0: int, j1: int) -> FloatArray:
        p, b, s = self.params, self.buffers, self.saved
        params = p[None, j0:j1] - p[:, None]
        cols = np.arange(j0, j1)
        for members, nbytes in self.ties:
            idx = np.asarray(members)
            # largest member index below j (or -1): the range [i, j) holds a member iff it is >= i
            pos = np.searchsorted(idx, cols, side="left") - 1
            last = np.where(pos >= 0, idx[np.maximum(pos, 0)], -1)
            params = params + nbytes * (self.rows[:, None] <= last[None, :])
        saved = s[None, j0:j1] - s[:, None] + self.resaved_cut[:, None]
        ranks = self.costs.runtime == "distributed"  # [Note: receive buffers] in stage_memory.py
        held = weight_held_bytes(self.weight_grad[None, j0:j1] - self.weight_grad[:, None],
                                 self.cut[None, j0:j1], True, False, ranks) if any(t[2] for t in self.terms) else 0
        last = cols == self.n  # the column j = n: the last stage ([Note: the loss's memory])
        cut_out = self.cut[np.minimum(cols, self.n)]
        kept = kept_bytes(self.costs, cut_out[None, :], last[None, :], self.costs.received_before(self.rows[:, None]))
        grads = np.where(last, self.loss_grads, 0)[None, :]
        cut_in, saved, input_saved = received_walk(ranks, self.cut[:, None], saved,
                                                   np.minimum(self.input_saved[:, None], saved))
        extras = range_extras(self.costs, params, j0, j1, self.n + 1, OPTIMIZER_FACTOR[self.optimizer],
                              *self.replicas, self.schedule, self.m,  # [Note: the backward's memory]
                              self.cut[:, None] if ranks else 0)
        act: FloatArray = (  # most blocks keep nothing and take the plain walk
            kept_activation_bytes(cut_in, saved, self.terms, held, input_saved, kept, grads, extras)
            if kept.any() or grads.any() or extras is not None
            else activation_bytes(cut_in, saved, self.terms, held, input_saved))
        if extras is not None and last.any() and self.costs.runtime == "gpipe":  # the gathered outputs
            gather = gather_level(self.costs, self.m, cut_in, saved, self.terms, held, input_saved, extras)
            act = np.where(last[None, :], np.maximum(act, gather), act)
        act = act + recomputed_outputs(cut_out[None, :], last[None, :], self.rec_n)
        if self.optimizer in STEP_TEMPORARIES:  # [Note: the optimizer step's memory]
            largest = self.costs.largest_params(j0, j1, self.n + 1) if self.costs.one_at_a_time else 0
            act = np.maximum(act, step_bytes(params, largest, self.optimizer, self.costs.one_at_a_time,
                                             *self.replicas))
        out: FloatArray = (state_bytes(params, b[None, j0:j1] - b[:, None], self.optimizer, *self.replicas)
                           + cast_cache_bytes(params, self.precision, self.rec_n) + act
                           + receive_bytes(self.costs, self.cut[:, None], cut_out[None, :], self.m))
        return out


BlockCost = Callable[[int, int, int], FloatArray]  # (stage k, j0, j1) -> (n+1, j1-j0), inf = invalid


def minmax_dp(n: int, k: int, block_cost: BlockCost) -> tuple[float, list[int]]:
    """min over contiguous splits of max_k block_cost; returns (value, stage start indices)."""
    inf = np.inf
    best = np.full(n + 1, inf)
    best[0] = 0.0
    choice = np.zeros((k, n + 1), dtype=np.int64)
    for s in range(k):
        new = np.full(n + 1, inf)
        for j0 in range(1, n + 1, _BLOCK):
            j1 = min(j0 + _BLOCK, n + 1)
            cand = np.maximum(best[:, None], block_cost(s, j0, j1))
            arg = np.argmin(cand, axis=0)
            new[j0:j1] = cand[arg, np.arange(j1 - j0)]
            choice[s, j0:j1] = arg
        best = new
    if not np.isfinite(best[n]):
        return inf, []
    starts, j = [], n
    for s in range(k - 1, -1, -1):
        j = int(choice[s, j])
        starts.append(j)
    return float(best[n]), starts[::-1]


def _assignment(n: int, starts: Sequence[int]) -> list[int]:
    out = [0] * n
    for s, i in enumerate(starts):
        end = starts[s + 1] if s + 1 < len(starts) else n
        out[i:end] = [s] * (end - i)
    return out


def solve_dp(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> DPResult:
    """The optimal contiguous split; PartitionError says which constraint makes it infeasible."""
    n, k = len(costs), len(devices)
    check_stage_count(n, k)
    schedule_ranks(options.schedule, devices)  # interleaved devices must take turns
    split = solve_split(costs, devices, options)
    if split is not None:
        return DPResult(split.assignment, split.bottleneck, split.modes)
    mode = options.modes(k)[0]
    rc = RangeCosts(costs, options, mode, first_stage_terms(options, k))
    if rc.forbidden[1:n].sum() > n - 1 - (k - 1):
        ties = options.ties == "colocate" and bool(costs.tie_groups)
        kept = " and ".join(["tie groups (ties='colocate')"] * ties + ["TP groups"] * bool(costs.tp_groups))
        raise PartitionError(f"keeping {kept} whole leaves {n - 1 - int(rc.forbidden[1:n].sum())} places to "
                             f"cut but {k} stages need {k - 1}; use fewer stages{' or ties=share' * ties}")
    assert any(d.memory is not None for d in devices), "a split without memory limits is always feasible"
    mem_cache: dict[tuple[int, int], FloatArray] = {}

    def memory(j0: int, j1: int) -> FloatArray:
        if (j0, j1) not in mem_cache:
            mem_cache[(j0, j1)] = rc.memory(j0, j1)
        return mem_cache[(j0, j1)]

    raise memory_error(costs, rc, devices, options, memory)


def memory_error(
    costs: LayerCosts,
    rc: RangeCosts,
    devices: Sequence[DeviceSpec],
    options: CostOptions,
    memory: Callable[[int, int], FloatArray],
) -> PartitionError:
    """Explain an infeasible memory limit in one line, with the fix that applies.

    In order: a layer whose parameters with optimizer state alone exceed the limit (no split
    can help: name it and the least memory any split needs); else, with one limit for every
    stage, the fewest stages that fit, and whether recompute='always' fits at this count; else
    the least memory any split needs.
    """
    n, k = rc.n, len(devices)
    limits = [d.memory for d in devices if d.memory is not None]
    roomiest = max(limits)
    state, params = layer_state_bytes(rc, options.optimizer)
    big = int(np.argmax(state))
    setting = f"recompute={_mode_text(options.recompute)}, optimizer={options.optimizer!r}"
    if state[big] > roomiest:
        return PartitionError(
            f"layer {rc.names[big]!r} alone needs {format_bytes(state[big])} for its parameters "
            f"({format_bytes(params[big])}) with {options.optimizer!r} optimizer state, more than "
            f"the {format_bytes(roomiest)} limit, so no split fits; the least memory any split "
            f"needs is {format_bytes(least_memory(rc, memory))} with {setting}: raise the limit to that "
            f"(--memory / memory_limit=) or split that layer into smaller modules"
        )
    if len(set(limits)) != 1 or len(limits) != k:
        need, _ = minmax_dp(n, k, _ratio(rc, devices, memory))
        return PartitionError(
            f"stage memory exceeds some device's limit by at least {100 * (need - 1):.1f}% with "
            f"{setting} and these {k} devices; give them more memory"
            + (" or use recompute='except_last'" if "never" in options.modes(k) else "")
        )
    limit = limits[0]
    need, _ = minmax_dp(n, k, _ratio(rc, devices, memory))
    head = (f"stage memory needs at least {format_bytes(need * limit)} with {setting} and {k} "
            f"stages; limit is {format_bytes(limit)}")
    fixes = []
    fewest = _whole_ranks(fewest_stages(rc, memory, limit), options.schedule)
    if fewest is not None:
        fixes.append(f"{fewest} stages{_ranks_text(fewest, options.schedule)} are the fewest that fit "
                     f"(--stages {fewest} / stages={fewest})")
    others = {mode: RangeCosts(costs, replace(options, recompute=mode), mode,
                               first_stage_terms(options, k, mode))
              for mode in ("except_last", "always") if mode != options.recompute}
    for mode, other in others.items():  # recomputation keeps fewer activations than 'never'
        if minmax_dp(n, k, _ratio(other, devices, other.memory))[0] <= 1.0:
            fixes.append(f"{k} stages fit with recompute={mode!r} (--recompute {mode} / "
                         f"recompute={mode!r})")
            break
    else:
        if fewest is None:
            for mode, other in others.items():
                count = _whole_ranks(fewest_stages(other, other.memory, limit), options.schedule)
                if count is not None:
                    fixes.append(f"{count} stages{_ranks_text(count, options.schedule)} fit with "
                                 f"recompute={mode!r} (--stages {count} "
                                 f"--recompute {mode} / stages={count}, recompute={mode!r})")
                    break
    if not fixes:
        fixes.append(f"no number of stages fits: the least memory any split needs is "
                     f"{format_bytes(least_memory(rc, memory))}; raise the limit to that "
                     f"(--memory / memory_limit=)")
    return PartitionError(f"{head}; {'; or '.join(fixes)}")


def _whole_ranks(stages: int | None, schedule: str) -> int | None:
    """``stages`` rounded up to fill whole ranks under a schedule that runs several a rank."""
    per = stages_per_rank(schedule)
    return None if stages is None else -(-stages // per) * per


def _ranks_text(stages: int, schedule: str) -> str:
    per = stages_per_rank(schedule)
    return f" ({stages // per} ranks of {per} stages, {schedule})" if per > 1 else ""


def _mode_text(recompute: str | Sequence[str]) -> str:
    return repr(recompute) if isinstance(recompute, str) else repr(list(recompute))


def _ratio(rc: RangeCosts, devices: Sequence[DeviceSpec], memory: Callable[[int, int], FloatArray]) -> BlockCost:
    """Stage memory over its device's limit (inf where the range is not a valid stage)."""
    def cost(s: int, j0: int, j1: int) -> FloatArray:
        limit = devices[s].memory
        mem = memory(j0, j1) / limit if limit else np.zeros((rc.n + 1, j1 - j0))
        out: FloatArray = np.where(rc.valid(j0, j1), mem, np.inf)
        return out
    return cost


def layer_state_bytes(rc: RangeCosts, optimizer: str) -> tuple[FloatArray, FloatArray]:
    """Each layer's parameters with optimizer state and buffers (``cost.state_bytes``), and its
    parameter bytes (tied ones included): what the layer needs in any stage that holds it."""
    params = np.diff(rc.params)
    for members, nbytes in rc.ties:
        params[list(members)] += nbytes
    state: FloatArray = state_bytes(params, np.diff(rc.buffers), optimizer, *rc.replicas)
    return state, params


def least_memory(rc: RangeCosts, memory: Callable[[int, int], FloatArray]) -> float:
    """The least peak stage memory of any split into any number of stages (bytes)."""
    best = np.full(rc.n + 1, np.inf)
    best[0] = 0.0
    for j in range(1, rc.n + 1):
        mem = memory(j, j + 1)[:, 0]
        ok = rc.valid(j, j + 1)[:, 0]
        best[j] = float(np.min(np.where(ok, np.maximum(best, mem), np.inf)))
    return float(best[rc.n])


def fewest_stages(rc: RangeCosts, memory: Callable[[int, int], FloatArray], limit: float,
                  most: int = 256) -> int | None:
    """The fewest stages (up to ``most``) whose every stage fits ``limit`` bytes, or None."""
    n = rc.n
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for s in range(1, min(n, most) + 1):
        new = np.full(n + 1, np.inf)
        for j0 in range(1, n + 1, _BLOCK):
            j1 = min(j0 + _BLOCK, n + 1)
            cand = np.where(rc.valid(j0, j1), np.maximum(best[:, None], memory(j0, j1)), np.inf)
            new[j0:j1] = cand.min(axis=0)
        best = new
        if best[n] <= limit:
            return s
    return None


def check_stage_count(n: int, k: int) -> None:
    if k < 1:
        raise PartitionError(f"stages={k}: need at least 1 stage")
    if k > n:
        raise PartitionError(
            f"stages={k} > {n} layers: a stage would be empty; use stages <= {n}"
        )
