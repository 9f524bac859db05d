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
fill-drain order (``autopipe.simulate`` reports the peaks of other schedules).

[Note: tied parameters] Layers with the same ``tie_group`` share a parameter whose bytes are the
largest ``param_bytes`` in the group. ``ties="share"`` charges them to every stage that holds a
member (the executor shares or replicates them); ``ties="colocate"`` forces the whole group onto
one stage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from autopipe.errors import PartitionError
from autopipe.profile import Profile

__all__ = [
    "CHECKPOINTS",
    "OPTIMIZER_FACTOR",
    "DeviceSpec",
    "CostOptions",
    "LayerCosts",
    "StageCost",
    "parse_bytes",
    "format_bytes",
    "resolve_devices",
    "recomputed_microbatches",
    "stage_costs",
]

Checkpoint = Literal["always", "except_last", "never"]
Ties = Literal["share", "colocate"]
CHECKPOINTS: tuple[str, ...] = ("always", "except_last", "never")
OPTIMIZER_FACTOR: dict[str, int] = {"none": 1, "sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None) -> int | None:
    """``16GiB``, ``512MB``, ``1.5 gb`` or a plain number of bytes -> int bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise PartitionError(f"memory limit {value} is negative; give bytes >= 0 or e.g. '16GiB'")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise PartitionError(
            f"cannot read memory size {value!r}; use bytes or a number with a unit like '16GiB', '512MB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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
        if self.checkpoint not in CHECKPOINTS:
            raise PartitionError(f"checkpoint={self.checkpoint!r}: choose one of {list(CHECKPOINTS)}")
        if self.optimizer not in OPTIMIZER_FACTOR:
            raise PartitionError(f"optimizer={self.optimizer!r}: choose one of {list(OPTIMIZER_FACTOR)}")
        if self.ties not in ("share", "colocate"):
            raise PartitionError(f"ties={self.ties!r}: choose 'share' or 'colocate'")
        if self.bandwidth is not None and self.bandwidth < 0:
            raise PartitionError(f"bandwidth={self.bandwidth}: need bytes/s >= 0 (0 or None = free)")

    @property
    def ms_per_byte(self) -> float:
        return 0.0 if not self.bandwidth else 1000.0 / self.bandwidth


def recomputed_microbatches(checkpoint: str, chunks: int) -> int:
    """How many of the M micro-batches are checkpointed (torchgpipe semantics)."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]


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
    factor = OPTIMIZER_FACTOR[options.optimizer]
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
        act = rec_n * cut_in + max(m - rec_n, 1) * saved if rec_n else m * saved
        result.append(StageCost(
            fwd_ms=fwd,
            bwd_ms=bwd,
            recompute_ms=fwd * rec_n / m,
            transfer_ms=(cut_in + cut_out) * options.ms_per_byte,
            param_bytes=params * factor + int(costs.buffers[mask].sum()),
            activation_bytes=int(act),
            input_bytes=cut_in,
            output_bytes=cut_out,
            saved_bytes=saved,
        ))
    return result
