"""The cost model: a stage's time and memory from a Profile, for any layer -> stage assignment.

Everything the partitioners optimise and the Plan reports is computed here, so the DP, the ILP,
the baselines and ``Plan.from_stages`` agree to the last byte.

[Note: stage time] A stage's time is its average work per micro-batch: forward + backward +
recompute (a second forward, for the micro-batches that are checkpointed) divided by the device's
relative speed, plus the transfers it sends (see [Note: transfer cost]). ``M x stage time`` is
the stage's busy time per iteration; the slowest stage (the bottleneck) sets the pipeline's pace.

[Note: transfer cost] A value (a layer's output, ``bytes`` = its largest outgoing edge) lives
from the stage that produces it up to the last stage that consumes it; it crosses every cut in
between, including the cuts of stages it merely passes through. Crossing a cut costs
``bytes / bandwidth`` forward (the activation) and again backward (its gradient). Each transfer
is charged to the stage that SENDS it: stage s pays its outgoing cut's activations and its
incoming cut's gradients, i.e. ``(input_bytes + output_bytes) / bandwidth``. Transfers are
assumed not to overlap compute (blocking sends), which is pessimistic on GPUs with copy engines.
``bandwidth=None`` or 0 makes transfers free. Graph inputs are not layers: they cost nothing.

[Note: stage memory] parameters x optimizer factor (``none`` 1 = weights only, ``sgd`` 2 =
+grads, ``momentum`` 3, ``adam``/``adamw`` 4) + buffers + activations. Activations of one
micro-batch are the stage's ``saved_bytes``. Checkpointing follows torchgpipe: ``always``
checkpoints all M micro-batches, ``except_last`` all but the last one (whose backward starts at
once), ``never`` none. A checkpointed micro-batch keeps only its stage input until its backward
recomputes it, so peak activations are ``R x input_bytes + max(M - R, 1) x saved_bytes`` with R
checkpointed micro-batches (``M x saved_bytes`` when R = 0), which is exact for GPipe's
fill-drain order (``autopipe.core.simulator`` reports the peaks of other schedules).

[Note: tied parameters] Layers with the same ``tie_group`` share a parameter whose bytes are the
largest ``param_bytes`` in the group. ``ties="share"`` charges them to every stage that holds a
member (the executor shares or replicates them); ``ties="colocate"`` forces the whole group onto
one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from autopipe.core.profile_table import Profile
from autopipe.core.units import parse_bytes
from autopipe.errors import PartitionError
from executor.spec import CHECKPOINT_MODES, recomputed_microbatches

__all__ = [
    "OPTIMIZER_FACTOR",
    "DeviceSpec",
    "CostOptions",
    "LayerCosts",
    "StageCost",
    "layer_work",
    "recompute_ms",
    "kept_microbatches",
    "activation_bytes",
    "state_bytes",
    "stage_time",
    "transfer_ms",
    "lower_bound",
    "resolve_devices",
    "stage_costs",
]

OPTIMIZER_FACTOR: dict[str, int] = {"none": 1, "sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# A number, a numpy array or a PuLP expression: each formula below takes any of them.
Amount = Any

# --- [Note: cost model] Every formula of stage time and memory is written once, below. ----------
# The DP evaluates them on numpy arrays of whole (first layer, last layer) blocks, the ILP on PuLP
# expressions, stage_costs / Plan / the baselines on floats; each function is plain arithmetic on
# its arguments, so one definition serves all of them. Change a formula here, and only here.


def recompute_ms(fwd: Amount, recomputed: int, chunks: int) -> Amount:
    """Average recomputation per micro-batch: a second forward for R of the M micro-batches."""
    return fwd * (recomputed / chunks)


def layer_work(fwd: Amount, bwd: Amount, recomputed: int, chunks: int) -> Amount:
    """Compute per micro-batch of a layer (or a sum of layers) on the profiled device, in ms:
    forward + backward + recompute ([Note: stage time])."""
    return fwd + recompute_ms(fwd, recomputed, chunks) + bwd


def transfer_ms(input_bytes: Amount, output_bytes: Amount, ms_per_byte: float) -> Amount:
    """What a stage spends sending: the gradients of its inputs and its output activations
    ([Note: transfer cost])."""
    return (input_bytes + output_bytes) * ms_per_byte


def stage_time(
    work: Amount, speed: float, input_bytes: Amount, output_bytes: Amount, ms_per_byte: float
) -> Amount:
    """A stage's time per micro-batch: its work on a device of relative ``speed``, plus the
    transfers at both of its cuts ([Note: stage time])."""
    return work / speed + transfer_ms(input_bytes, output_bytes, ms_per_byte)


def kept_microbatches(recomputed: int, chunks: int) -> int:
    """How many micro-batches' full activations a stage holds at its peak ([Note: stage memory]):
    all M without recomputation, else those not recomputed (at least the one being recomputed)."""
    return max(chunks - recomputed, 1) if recomputed else chunks


def activation_bytes(input_bytes: Amount, saved_bytes: Amount, recomputed: int, chunks: int) -> Amount:
    """Peak activation bytes of a stage under GPipe: the inputs of the R recomputed micro-batches
    plus the full ``saved_bytes`` of the kept ones ([Note: stage memory])."""
    return recomputed * input_bytes + kept_microbatches(recomputed, chunks) * saved_bytes


def state_bytes(param_bytes: Amount, buffer_bytes: Amount, optimizer: str) -> Amount:
    """Parameters with their gradients and optimizer state (``OPTIMIZER_FACTOR``), plus buffers."""
    return param_bytes * OPTIMIZER_FACTOR[optimizer] + buffer_bytes


def lower_bound(work: FloatArray, speeds: Sequence[float]) -> float:
    """No split's bottleneck is below max(total work / total speed, largest layer / fastest)."""
    if len(work) == 0:
        return 0.0
    return max(float(work.sum()) / sum(speeds), float(work.max()) / max(speeds))


@dataclass(frozen=True)
class DeviceSpec:
    """One pipeline device: its name, memory in bytes (None = unlimited) and relative speed
    (2.0 = twice as fast as the device the profile was measured on)."""

    name: str
    memory: int | None = None
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise PartitionError(f"device {self.name!r} has speed {self.speed}; speed must be > 0")
        if self.memory is not None and self.memory < 0:
            raise PartitionError(f"device {self.name!r} has negative memory {self.memory}")


def resolve_devices(
    stages: int | None,
    devices: Sequence[DeviceSpec | str] | None,
    memory_limit: int | str | None = None,
) -> list[DeviceSpec]:
    """Turn ``stages=K`` or a device list (+ a global memory limit) into K DeviceSpecs."""
    limit = parse_bytes(memory_limit)
    if devices is None:
        if stages is None:
            raise PartitionError("give stages=K or devices=[...]: the number of stages is unknown")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise PartitionError(f"stages={stages!r}: need an integer K >= 1")
        return [DeviceSpec(f"stage{k}", limit) for k in range(stages)]
    specs = [DeviceSpec(d) if isinstance(d, str) else d for d in devices]
    if not specs:
        raise PartitionError("devices=[] is empty: give at least one device")
    if stages is not None and stages != len(specs):
        raise PartitionError(f"stages={stages} but {len(specs)} devices given; drop one or make them agree")
    if limit is not None:
        specs = [DeviceSpec(d.name, limit if d.memory is None else min(d.memory, limit), d.speed) for d in specs]
    return specs


@dataclass(frozen=True)
class CostOptions:
    chunks: int = 8
    checkpoint: str = "except_last"
    optimizer: str = "adam"
    bandwidth: float | None = 10e9
    ties: str = "share"

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise PartitionError(f"chunks={self.chunks!r}: need an integer number of micro-batches >= 1")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise PartitionError(f"checkpoint={self.checkpoint!r}: choose one of {list(CHECKPOINT_MODES)}")
        if self.optimizer not in OPTIMIZER_FACTOR:
            raise PartitionError(f"optimizer={self.optimizer!r}: choose one of {list(OPTIMIZER_FACTOR)}")
        if self.ties not in ("share", "colocate"):
            raise PartitionError(f"ties={self.ties!r}: choose 'share' or 'colocate'")
        if self.bandwidth is not None and self.bandwidth < 0:
            raise PartitionError(f"bandwidth={self.bandwidth}: need bytes/s >= 0 (0 or None = free)")

    @property
    def ms_per_byte(self) -> float:
        return 0.0 if not self.bandwidth else 1000.0 / self.bandwidth


@dataclass(frozen=True)
class LayerCosts:
    """A Profile as numpy arrays in layer (topological) order; what the solvers read."""

    names: tuple[str, ...]
    fwd: FloatArray
    bwd: FloatArray
    params: IntArray  # untied parameter bytes (tied ones live in ``tie_groups``)
    buffers: IntArray
    saved: IntArray
    value_bytes: IntArray  # bytes of each layer's output value as sent across a cut
    consumers: tuple[tuple[int, ...], ...]
    last_use: IntArray  # index of the last consumer (the layer itself when none)
    tie_groups: tuple[tuple[tuple[int, ...], int], ...]  # (member indices, shared bytes)

    @classmethod
    def from_profile(cls, profile: Profile) -> LayerCosts:
        df = profile.df
        names = tuple(profile.layers)
        index = {name: i for i, name in enumerate(names)}
        n = len(names)
        value = np.zeros(n, dtype=np.int64)
        consumers: list[list[int]] = [[] for _ in range(n)]
        for src, dst, nbytes in profile.edges:
            u, v = index[src], index[dst]
            value[u] = max(value[u], nbytes)
            consumers[u].append(v)
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
        return cls(
            names=names,
            fwd=df["fwd_ms"].to_numpy(dtype=np.float64),
            bwd=df["bwd_ms"].to_numpy(dtype=np.float64),
            params=params,
            buffers=df["buffer_bytes"].to_numpy(dtype=np.int64),
            saved=df["saved_bytes"].to_numpy(dtype=np.int64),
            value_bytes=value,
            consumers=tuple(tuple(sorted(set(c))) for c in consumers),
            last_use=last,
            tie_groups=tuple(ties),
        )

    def __len__(self) -> int:
        return len(self.names)

    def cut_bytes(self) -> IntArray:
        """``cut[i]``: bytes live between layer i-1 and layer i when the order is cut there."""
        n = len(self)
        diff = np.zeros(n + 2, dtype=np.int64)
        for u in range(n):
            if self.last_use[u] > u:
                diff[u + 1] += self.value_bytes[u]
                diff[self.last_use[u] + 1] -= self.value_bytes[u]
        return np.cumsum(diff)[: n + 1]


@dataclass(frozen=True)
class StageCost:
    """One stage's predicted cost per micro-batch (times in ms) and peak memory (bytes)."""

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    transfer_ms: float
    param_bytes: int  # parameters + gradients + optimizer state + buffers
    activation_bytes: int
    input_bytes: int
    output_bytes: int
    saved_bytes: int  # one micro-batch's activations kept for backward


    @property
    def time_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms + self.recompute_ms + self.transfer_ms

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes


def stage_costs(
    costs: LayerCosts,
    assignment: Sequence[int],
    devices: Sequence[DeviceSpec],
    options: CostOptions,
) -> list[StageCost]:
    """Cost of every stage when layer i runs on stage ``assignment[i]`` (0-based)."""
    k = len(devices)
    stage = np.asarray(assignment, dtype=np.int64)
    if stage.shape != (len(costs),):
        raise PartitionError(f"assignment has {stage.size} entries for {len(costs)} layers")
    m = options.chunks
    rec_n = recomputed_microbatches(options.checkpoint, m)
    cut = np.zeros(max(k - 1, 0), dtype=np.int64)  # bytes crossing cut s (between s and s+1)
    for u, users in enumerate(costs.consumers):
        if users:
            reach = int(stage[list(users)].max())
            cut[stage[u]:reach] += costs.value_bytes[u]
    result = []
    for s, dev in enumerate(devices):
        mask = stage == s
        fwd = float(costs.fwd[mask].sum()) / dev.speed
        bwd = float(costs.bwd[mask].sum()) / dev.speed
        params = int(costs.params[mask].sum())
        for members, nbytes in costs.tie_groups:
            if mask[list(members)].any():
                params += nbytes
        saved = int(costs.saved[mask].sum())
        cut_in = int(cut[s - 1]) if s > 0 else 0
        cut_out = int(cut[s]) if s < k - 1 else 0
        result.append(StageCost(
            fwd_ms=fwd,
            bwd_ms=bwd,
            recompute_ms=recompute_ms(fwd, rec_n, m),
            transfer_ms=transfer_ms(cut_in, cut_out, options.ms_per_byte),
            param_bytes=state_bytes(params, int(costs.buffers[mask].sum()), options.optimizer),
            activation_bytes=activation_bytes(cut_in, saved, rec_n, m),
            input_bytes=cut_in,
            output_bytes=cut_out,
            saved_bytes=saved,
        ))
    return result
