"""A Profile as numpy arrays in layer order: what the cost model and the solvers read.

[Note: saved once] A tensor that two layers save for backward is held once: a ReLU saves its
output and the Linear after it saves the same tensor as its input. Each layer is profiled
alone, so both count it; the profile's ``saved_shared_bytes`` says how much of a layer's
``saved_bytes`` its producers already save (autopipe.frontend.profiling.harness.layer_timing.shared_saved), and
``LayerCosts.saved`` is the difference, so a stage's sum counts such a tensor once, in the
layer that made it. The graph's own inputs (the caller's batch, which a first layer saves a
view of) are shared too: they are not the pipeline's to hold ([Note: transfer cost] in
transfer.py: graph inputs cost nothing). Where a cut separates the two, the consuming stage holds
its own copy (its received input): ``resaved[u]``, the most of u's output that u and any one
consumer both save, is charged to every stage u's value crosses into while a consumer that saves
it lies beyond the cut (``resaved_cut()``, up to ``last_saver[u]``, as ``cut_bytes()`` charges
the value itself up to its last use): exact for chains and for a value whose saving consumer is
not its last (a U-Net's skip, pooled before it is concatenated; a residual stream's LayerNorm,
whose last consumer is the add), on the safe side for a stage the value only passes through and
for a recomputed micro-batch (whose saved input is that same copy).
executor/activation_meter.py counts the same thing in a running pipeline.

[Note: what a consumer reads] A layer may make several values (HF Llama's embedding layer holds
the token embedding, the causal mask and the sequence length, each read by other layers), and a
profile's edge carries what ITS consumer reads. A cut is crossed by what the consumers beyond it
read, not by the layer's largest value: the stage built there passes them (the mask and an int,
not the embedding, measured on a 4-block Llama: 172 kB, where the largest value charged 295 kB).
``cut_bytes()``, a stage's crossings (cost.py) and a recomputed segment's copies of what enters
it (recomputed_layers.py) charge, of each layer, the most one consumer beyond the cut (in the
segment) reads; ``value_bytes`` (the largest edge) stays what the layer's own outputs weigh.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from autopipe.core.corrections import call_fallbacks
from autopipe.core.planned_precision import precision_of
from autopipe.core.profile_table import RETURNED_COLUMN, SPLIT_COLUMNS, WORKING_COLUMN, Profile
from autopipe.core.tensor_parallel import COLUMN, ROW, SHARDED

__all__ = ["FloatArray", "IntArray", "LayerCosts", "SPLIT_COLUMNS", "range_max"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class LayerCosts:
    """A Profile as numpy arrays in layer (topological) order; what the solvers read."""

    names: tuple[str, ...]
    fwd: FloatArray
    bwd: FloatArray
    params: IntArray  # untied parameter bytes (tied ones live in ``tie_groups``)
    buffers: IntArray
    saved: IntArray
    saved_input: IntArray  # of each layer's saves, its inputs from other layers ([Note: an input kept once])
    resaved: IntArray  # of each layer's output, what it and a consumer both save ([Note: saved once])
    savers: tuple[tuple[int, ...], ...]  # of each layer's consumers, those that save its output too
    value_bytes: IntArray  # bytes of each layer's output value as sent across a cut (its largest edge)
    consumers: tuple[tuple[int, ...], ...]
    last_use: IntArray  # index of the last consumer (the layer itself when none)
    tie_groups: tuple[tuple[tuple[int, ...], int], ...]  # (member indices, shared bytes)
    # [Note: measured overheads], of the runtime these costs are for ([Note: one profile, two
    # runtimes] in autopipe/core/corrections.py); not measured: zero
    call_fwd_ms: float = 0.0
    call_bwd_ms: float = 0.0
    # that runtime's call cost under other schedules, where measured: (schedule, forward, backward)
    schedule_calls: tuple[tuple[str, float, float], ...] = ()
    recompute_ratio: float = 1.0
    recompute_call_ms: float = 0.0  # per stage and recomputed micro-batch
    # [Note: transfer cost]: measured between two ranks (autopipe profile --comm), else absent
    comm_latency_ms: float = 0.0
    comm_bandwidth: float | None = None  # bytes/s
    comm_receive_share: float = 0.0  # of a crossing's bytes, paid by the receiver too
    runtime: str = "gpipe"  # executor.GPipe in one process, or "distributed"
    precision: str = "fp32"  # what the profile measured under ([Note: mixed precision memory] in cost.py)
    # [Note: split backward time] in cost.py: of ``bwd``, the input-gradient part, and the bytes
    # a layer's weight pass starts from; None where the profile has no split
    bwd_input: FloatArray | None = None
    weight_grad: IntArray | None = None
    # what the two halves of a split backward take over the whole (the profile's
    # ``meta["bwd_split_ratio"]``; 1 where it did not measure it)
    split_ratio: float = 1.0
    # a profile at a TP degree > 1 ([Note: tensor-parallel cost]): each group's column ... row
    # layers, which one stage must hold whole (the values inside are split over the ranks)
    tp_groups: tuple[tuple[int, ...], ...] = ()
    # [Note: the loss's memory] in stage_memory.py: per micro-batch, what the last stage keeps from its
    # forward to its backward besides its layers' saves (the model's output, the loss's saves),
    # and what the loss's backward has alive on top of that
    loss_kept: int = 0
    returned: int = 0  # of loss_kept, the model's outputs (executor.GPipe gathers them: [Note: the backward's memory])
    # of returned, what the layers before layer i return (n + 1 entries): on ranks a last stage
    # starting at i receives those, in its receive buffers ([Note: receive buffers])
    returned_before: IntArray | None = None
    loss_grads: int = 0
    # [Note: the optimizer step's memory] in stage_memory.py: each layer's parameter bytes, tied ones
    # included (the largest tensor a stage steps is at most its largest layer's), and whether
    # torch's optimizers step one tensor at a time there (the CPU) or all at once (foreach)
    layer_params: IntArray | None = None
    one_at_a_time: bool = True
    # [Note: the backward's memory] in backward_memory.py: per layer, what its backward has alive
    # beyond its saves, the gradient it receives included (the bytes its readers read + the
    # profile's ``bwd_working_bytes``; what only the loss reads has the loss's gradient, in
    # ``loss_grads``); None where the profile did not measure it
    working: IntArray | None = None
    # [Note: what a consumer reads] each edge's own bytes, as ``consumers`` lists them (empty:
    # every edge sends ``value_bytes``)
    sent: tuple[tuple[int, ...], ...] = ()

    def call_ms(self, schedule: str = "gpipe") -> float:
        """The fixed cost of one stage call per micro-batch under ``schedule``, forward +
        backward (:meth:`call_for`)."""
        return sum(self.call_for(schedule))

    def call_for(self, schedule: str) -> tuple[float, float]:
        """(forward, backward) call cost under ``schedule``: the first the profile measured of
        ``call_fallbacks(schedule)`` ([Note: zero-bubble calls] in corrections.py)."""
        measured = {name: (fwd, bwd) for name, fwd, bwd in self.schedule_calls}
        for name in call_fallbacks(schedule)[:-1]:  # the last, GPipe's, is call_fwd_ms / call_bwd_ms
            if name in measured:
                return measured[name]
        return self.call_fwd_ms, self.call_bwd_ms

    def kept_together(self, ties: str) -> list[tuple[int, ...]]:
        """Layer groups a split must not cut: the tie groups under ``ties="colocate"`` and the TP
        groups of a profile at a TP degree (a cut inside one would carry split values)."""
        return [*(members for members, _ in self.tie_groups if ties == "colocate"), *self.tp_groups]

    def forbidden_cuts(self, ties: str) -> np.ndarray:
        """Per cut position j (0 .. n: a stage or a segment beginning at layer j), whether it
        falls inside a group of :meth:`kept_together`."""
        forbidden = np.zeros(len(self) + 1, dtype=bool)
        for members in self.kept_together(ties):
            forbidden[min(members) + 1: max(members) + 1] = True
        return forbidden

    @classmethod
    def from_profile(cls, profile: Profile, runtime: str | None = None) -> LayerCosts:
        """``profile``'s costs for ``runtime`` (default: the profile's, the distributed one where
        it was measured): its call costs; the transfer and the ranks' slowdown for the
        distributed runtime only ([Note: one profile, two runtimes])."""
        chosen = profile.corrections.default_runtime() if runtime is None else runtime
        c = profile.corrections.for_runtime(chosen)
        calls = c.stage_calls[chosen]
        df = profile.df
        names = tuple(profile.layers)
        index = {name: i for i, name in enumerate(names)}
        n = len(names)
        value = np.zeros(n, dtype=np.int64)
        consumers: list[list[int]] = [[] for _ in range(n)]
        reads: list[dict[int, int]] = [{} for _ in range(n)]  # [Note: what a consumer reads]
        for src, dst, nbytes in profile.edges:
            u, v = index[src], index[dst]
            value[u] = max(value[u], nbytes)
            consumers[u].append(v)
            reads[u][v] = max(reads[u].get(v, 0), int(nbytes))
        last = np.array([max(c, default=i) for i, c in enumerate(consumers)], dtype=np.int64)
        params = df["param_bytes"].to_numpy(dtype=np.int64).copy()
        groups: dict[str, list[int]] = {}
        for i, g in enumerate(df["tie_group"]):
            if g:
                groups.setdefault(str(g), []).append(i)
        ties = []
        for members in groups.values():
            ties.append((tuple(members), int(params[members].max())))
            params[members] = 0
        saved = df["saved_bytes"].to_numpy(dtype=np.int64)
        shared = df["saved_shared_bytes"].to_numpy(dtype=np.int64)
        savers = [[v for v in users if shared[v] > 0] for users in consumers]
        resaved = np.array([min(int(value[u]), max((int(shared[v]) for v in savers[u]), default=0))
                            for u in range(n)], dtype=np.int64)
        bwd = df["bwd_ms"].to_numpy(dtype=np.float64).copy()
        each = df[RETURNED_COLUMN].to_numpy(dtype=np.int64) if RETURNED_COLUMN in df.columns else np.array(
            [int(b) if not users else 0 for b, users in zip(df["output_bytes"], consumers, strict=True)],
            dtype=np.int64)  # the model's outputs, by the layer that makes them
        outputs = int(each.sum())
        if n:  # [Note: the loss in the last stage]: the last layer's backward carries the loss
            bwd[-1] += 0.0 if c.loss is None else c.loss.fwd_ms + c.loss.bwd_ms
        # [Note: ranks sharing a host] (autopipe/frontend/profiling/spawned/rank_contention.py): ranks on one
        # host compute beside each other, each this much slower than the profile timed it alone
        beside = max(c.rank_compute_slowdown or 1.0, 1.0)
        gpipe = calls.get("gpipe")
        bwd_input = None
        if all(col in df.columns for col in SPLIT_COLUMNS):  # the input part's share of bwd_ms
            parts = df["bwd_input_ms"].to_numpy(dtype=np.float64) + df["bwd_weight_ms"].to_numpy(dtype=np.float64)
            share = np.divide(df["bwd_input_ms"].to_numpy(dtype=np.float64), parts,
                              out=np.ones(n), where=parts > 0)
            bwd_input = df["bwd_ms"].to_numpy(dtype=np.float64) * share
            if n:  # the loss's backward reaches the last layer's inputs: the input part
                bwd_input[-1] += bwd[-1] - float(df["bwd_ms"].iloc[-1])
        return cls(
            names=names,
            fwd=df["fwd_ms"].to_numpy(dtype=np.float64) * beside,
            bwd=bwd * beside,
            params=params,
            buffers=df["buffer_bytes"].to_numpy(dtype=np.int64),
            saved=np.maximum(saved - shared, 0),
            saved_input=df["saved_input_bytes"].to_numpy(dtype=np.int64),
            resaved=resaved,
            savers=tuple(tuple(sorted(set(users))) for users in savers),
            value_bytes=value,
            consumers=tuple(tuple(sorted(set(c))) for c in consumers),
            last_use=last,
            tie_groups=tuple(ties),
            call_fwd_ms=0.0 if gpipe is None else gpipe.fwd_ms,
            call_bwd_ms=0.0 if gpipe is None else gpipe.bwd_ms,
            schedule_calls=tuple((name, p.fwd_ms, p.bwd_ms) for name, p in calls.items() if name != "gpipe"),
            recompute_ratio=c.recompute_ratio,
            recompute_call_ms=c.recompute_call_ms,
            comm_latency_ms=0.0 if c.transfer is None else c.transfer.latency_ms,
            # unmeasured or not growing with the bytes: the partitioner's default bandwidth, as before
            comm_bandwidth=None if c.transfer is None or not np.isfinite(c.transfer.bandwidth)
            else c.transfer.bandwidth,
            comm_receive_share=0.0 if c.transfer is None else c.transfer.receive_share,
            runtime=chosen,
            precision=precision_of(profile.meta),
            bwd_input=None if bwd_input is None else bwd_input * beside,
            weight_grad=None if bwd_input is None else df["weight_grad_bytes"].to_numpy(dtype=np.int64),
            split_ratio=max(float(profile.meta.get("bwd_split_ratio") or 1.0), 1.0),
            tp_groups=_tp_groups(df, int(profile.meta.get("tensor_parallel") or 1)),
            loss_kept=outputs + (0 if c.loss is None else c.loss.held_bytes),
            returned=outputs,
            returned_before=np.concatenate([[0], np.cumsum(each)]).astype(np.int64),
            layer_params=df["param_bytes"].to_numpy(dtype=np.int64),
            one_at_a_time=str(profile.meta.get("device_type") or "cpu") == "cpu",
            loss_grads=0 if c.loss is None else max(c.loss.peak_bytes - c.loss.held_bytes, 0),
            working=(df[WORKING_COLUMN].to_numpy(dtype=np.int64) + value  # + the gradient its readers send
                     if WORKING_COLUMN in df.columns else None),
            sent=tuple(tuple(r[v] for v in sorted(r)) for r in reads),
        )

    def __len__(self) -> int:
        return len(self.names)

    def largest_params(self, j0: int, j1: int, rows: int) -> FloatArray:
        """(rows, j1 - j0): the largest ``layer_params[i:j]`` of every range i < j, j0 <= j < j1
        (0 where i >= j): what a stage of those layers steps one tensor at a time ([Note: the
        optimizer step's memory] in stage_memory.py)."""
        return range_max(np.zeros(len(self)) if self.layer_params is None else self.layer_params, j0, j1, rows)

    def received_before(self, start: Any) -> Any:
        """What the layers before layer ``start`` (an index or an array of them) return: what a
        last stage starting there receives of the model's outputs ([Note: receive buffers])."""
        return 0 if self.returned_before is None else self.returned_before[start]

    def reads(self, u: int) -> tuple[tuple[int, int], ...]:
        """(consumer, the bytes it reads of layer u's outputs) for each consumer of u ([Note:
        what a consumer reads])."""
        sent = self.sent[u] if self.sent else (int(self.value_bytes[u]),) * len(self.consumers[u])
        return tuple(zip(self.consumers[u], sent, strict=True))

    def cut_bytes(self) -> IntArray:
        """``cut[i]``: bytes live between layer i-1 and layer i when the order is cut there: of
        each earlier layer, the most that one consumer at or after i reads of it ([Note: what a
        consumer reads])."""
        diff = np.zeros(len(self) + 2, dtype=np.int64)
        for u in range(len(self)):
            level = 0
            for v, b in sorted(self.reads(u), reverse=True):  # the farthest consumer first
                if v > u and b > level:
                    diff[u + 1] += b - level
                    diff[v + 1] -= b - level
                    level = b
        return np.cumsum(diff)[: len(self) + 1]

    def resaved_cut(self) -> IntArray:
        """``cut[i]``: of ``cut_bytes()[i]``, what the stage starting at layer i keeps a copy of
        for its consumers' backward ([Note: saved once])."""
        return self._spans(self.resaved, self.last_saver)

    @functools.cached_property
    def last_saver(self) -> IntArray:
        """Index of each layer's last consumer that saves its output too (itself when none);
        made once (read one layer at a time in loops over every layer: recomputed_layers.py)."""
        out = np.array([max(users, default=u) for u, users in enumerate(self.savers)], dtype=np.int64)
        out.flags.writeable = False
        return out

    def input_saved_cut(self) -> IntArray:
        """``cut[i]``: of ``cut_bytes()[i]``, what layer i saves when it starts a stage, which a
        recomputed micro-batch holds once ([Note: an input kept once] in stage_memory.py)."""
        out = np.zeros(len(self) + 1, dtype=np.int64)
        out[1:-1] = np.minimum(self.saved_input[1:], self.cut_bytes()[1:-1])
        return out

    def _spans(self, values: IntArray, until: IntArray) -> IntArray:
        n = len(self)
        diff = np.zeros(n + 2, dtype=np.int64)
        for u in range(n):
            if until[u] > u:
                diff[u + 1] += values[u]
                diff[until[u] + 1] -= values[u]
        return np.cumsum(diff)[: n + 1]


def range_max(values: npt.ArrayLike, j0: int, j1: int, rows: int) -> FloatArray:
    """(rows, j1 - j0): the largest ``values[i:j]`` of every range i < j, j0 <= j < j1 (0 where
    i >= j): rows below j0 take the larger of their suffix up to j0 and the columns' prefix from
    j0; rows from j0 a running maximum along their row of the columns they precede."""
    p = np.asarray(values, dtype=np.float64)
    cols = max(j1 - j0, 0)
    out = np.zeros((rows, cols))
    if not cols:
        return out
    grown = np.maximum.accumulate(np.concatenate([[-np.inf], p[j0:j1 - 1]]))  # max(p[j0:j]) per column
    top = min(j0, rows)
    if top:
        out[:top] = np.maximum(np.maximum.accumulate(p[:j0][::-1])[::-1][:top, None], grown[None, :])
    lo, hi = j0, min(j1 - 1, rows)  # rows i in [j0, j1 - 1): columns j > i
    if hi > lo:
        i = np.arange(lo, hi)[:, None]
        j = np.arange(j0, j1)[None, :]
        block = np.maximum.accumulate(np.where(j - 1 >= i, p[np.maximum(j - 1, 0)], -np.inf), axis=1)
        out[lo:hi] = np.where(j > i, block, 0.0)
    return out


SPLIT_GROUP_ROLES = (COLUMN, SHARDED, ROW)


def _tp_groups(df: Any, degree: int) -> tuple[tuple[int, ...], ...]:
    """The layers of each TP group split at ``degree`` ([Note: tensor-parallel cost])."""
    if degree < 2 or "tp_group" not in df.columns or "tp_role" not in df.columns:
        return ()
    groups: dict[str, list[int]] = {}
    for i, (group, role) in enumerate(zip(df["tp_group"], df["tp_role"], strict=True)):
        if group and role in SPLIT_GROUP_ROLES:
            groups.setdefault(str(group), []).append(i)
    return tuple(tuple(m) for m in groups.values() if len(m) > 1)
