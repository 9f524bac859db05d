"""Corrections: what a profile measured besides its layers, typed, in one frozen value.

    prof.corrections.stage_calls["gpipe"]["gpipe"]        # Phases(fwd_ms=..., bwd_ms=...)
    prof.corrections.loss                                 # LossCost(...) or None
    prof.corrections.for_runtime("distributed")           # what that runtime's plan reads

[Note: one profile, two runtimes] Summing layers timed alone misses costs a pipeline pays
([Note: measured overheads] in autopipe/frontend/profiling/corrections/overheads.py), and which ones depends
on the runtime the plan is for. ``autopipe.profile`` measures each in one step of its ordered
list (autopipe/frontend/profiling/steps.py), and each step fills one field here:

- ``harness``: the layer harness's own empty call, already subtracted from every layer.
- ``stage_calls[runtime][schedule]``: the fixed cost of one stage call per micro-batch, forward
  and backward. ``"gpipe"`` is executor.GPipe in one process (fill-drain only: its one schedule
  is ``"gpipe"``), timed by every profile; ``"distributed"`` is torch.distributed.pipelining
  on two ranks under each schedule it ran (``comm=True``: [Note: measured transfer]). One
  profile keeps both, so it predicts either runtime with that runtime's own cost.
- ``recompute_call_ms``, ``recompute_ratio``: what a checkpointed stage call and a recomputed
  forward cost ([Note: measured overheads]).
- ``sequence``: the scales by which the layers' times were brought to the whole graph's
  ([Note: layers in sequence]), already applied to the rows.
- ``loss``: the loss's forward and backward per micro-batch, which the last layer's backward
  carries ([Note: the loss in the last stage]); None where it was not timed.
- ``transfer``: a crossing between two ranks ([Note: transfer cost]), and
  ``rank_compute_slowdown``: ranks sharing a host ([Note: ranks sharing a host]); both are
  the distributed runtime's only.

:meth:`Corrections.for_runtime` is the profile as one runtime sees it: that runtime's call costs
(where interleaved 1F1B was not measured, 1F1B's; the zero-bubble schedules, never measured
yet, interleaved 1F1B's: [Note: zero-bubble calls]; where a schedule was not, its GPipe's), and
for the in-process runtime no transfer latency and no slowdown. Where the distributed runtime's
calls were not measured but executor.GPipe's were, it plans with executor.GPipe's and says so
in a warning. The JSON form (the ``"corrections"`` object of a profile's side file) names every
field: a missing or unknown key is a ProfileError naming it. Profiles saved before this kept
the same numbers as flat ``meta`` keys; :meth:`Corrections.from_legacy_meta` reads them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopipe.errors import ProfileError
from executor.spec import SCHEDULES, ZERO_BUBBLE_SCHEDULES

__all__ = ["RUNTIMES", "Corrections", "InSequence", "LossCost", "Phases", "Transfer", "call_fallbacks",
           "is_legacy_key"]

RUNTIMES: tuple[str, ...] = ("gpipe", "distributed")  # executor.GPipe; torch.distributed.pipelining
_RERUN = "re-run `autopipe profile ...`"
# the schedules whose calls measure_comm's flat keys carry beside GPipe's (profiles saved before
# the corrections object timed the first two)
_LEGACY_SCHEDULES = tuple(s for s in SCHEDULES if s != "gpipe")


def call_fallbacks(schedule: str) -> tuple[str, ...]:
    """The schedules whose measured call cost ``schedule``'s plans pay, first measured first:
    its own, then interleaved 1F1B's for the zero-bubble schedules and 1F1B's for interleaved
    1F1B, then GPipe's. [Note: zero-bubble calls] ``profile --comm`` times every schedule on
    empty stages (autopipe/frontend/profiling/spawned/comm.py), where torch runs the profile's chunks
    on them; a profile measured before the zero-bubble schedules ran on ranks (or at chunks
    torch refuses for one) lacks theirs, and their plans pay the closest runtime's: torch's
    _PipelineScheduleRuntime runs interleaved 1F1B and all three through the same action loop,
    with messages per action alike. A split backward's two calls share the backward's call
    cost half and half (``cost.split_backward_ms``)."""
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return (schedule, "interleaved1f1b", "1f1b", "gpipe")
    if schedule == "interleaved1f1b":
        return (schedule, "1f1b", "gpipe")
    return (schedule, "gpipe")


def _number(value: Any, key: str, *, optional: bool = False) -> float:
    if optional and value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{key} must be a finite number >= 0, got {value!r}; {_RERUN}")
    return float(value)


def _fields(data: Any, key: str, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ProfileError(f"{key} must be an object with {list(names)}, got {data!r}; {_RERUN}")
    for name in names:
        if name not in data:
            raise ProfileError(f"{key} lacks key {name!r} (it needs {list(names)}); {_RERUN}")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ProfileError(f"{key} has unknown key {unknown[0]!r} (it takes {list(names)}); {_RERUN}")
    return dict(data)


@dataclass(frozen=True)
class Phases:
    """A forward and a backward time, ms."""

    fwd_ms: float
    bwd_ms: float

    def check(self, key: str) -> None:
        _number(self.fwd_ms, f"{key}.fwd_ms")
        _number(self.bwd_ms, f"{key}.bwd_ms")

    def to_json(self) -> dict[str, Any]:
        return {"fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms}

    @classmethod
    def from_json(cls, data: Any, key: str) -> Phases:
        d = _fields(data, key, ("fwd_ms", "bwd_ms"))
        return cls(_number(d["fwd_ms"], f"{key}.fwd_ms"), _number(d["bwd_ms"], f"{key}.bwd_ms"))


@dataclass(frozen=True)
class InSequence:
    """Whole graph / sum of the layers alone, forward and backward, and the rounds timed."""

    fwd_scale: float
    bwd_scale: float
    rounds: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, key: str) -> InSequence:
        d = _fields(data, key, ("fwd_scale", "bwd_scale", "rounds"))
        return cls(_number(d["fwd_scale"], f"{key}.fwd_scale"), _number(d["bwd_scale"], f"{key}.bwd_scale"),
                   int(_number(d["rounds"], f"{key}.rounds")))


@dataclass(frozen=True)
class LossCost:
    """The loss's forward and backward ms on one micro-batch of ``micro_batch_size`` rows, and
    its bytes there ([Note: the loss's memory] in autopipe/core/stage_memory.py): ``held_bytes``, what
    its forward keeps until its backward (cross-entropy's log-softmax); ``peak_bytes``, the most
    it has alive at once, its backward's gradients included. Profiles saved before the bytes
    were counted read them as 0."""

    fwd_ms: float
    bwd_ms: float
    micro_batch_size: int
    held_bytes: int = 0
    peak_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scaled(self, rows: int) -> LossCost:
        """At a micro-batch of ``rows`` rows: every figure grows with the rows."""
        scale = rows / self.micro_batch_size if self.micro_batch_size > 0 else 1.0
        return LossCost(self.fwd_ms * scale, self.bwd_ms * scale, rows, round(self.held_bytes * scale),
                        round(self.peak_bytes * scale))

    @classmethod
    def from_json(cls, data: Any, key: str) -> LossCost:
        names = ("fwd_ms", "bwd_ms", "micro_batch_size")
        counted = ("held_bytes", "peak_bytes")  # absent in profiles saved before they were counted
        d = _fields(data, key, names + tuple(c for c in counted if isinstance(data, Mapping) and c in data))
        return cls(_number(d["fwd_ms"], f"{key}.fwd_ms"), _number(d["bwd_ms"], f"{key}.bwd_ms"),
                   int(_number(d["micro_batch_size"], f"{key}.micro_batch_size")),
                   *(int(_number(d.get(c, 0), f"{key}.{c}")) for c in counted))


@dataclass(frozen=True)
class Transfer:
    """A crossing between two ranks: ``latency_ms + bytes / bandwidth`` (bytes/s; ``inf``: the
    time does not grow with the bytes), of which the receiver pays ``receive_share`` too."""

    latency_ms: float
    bandwidth: float
    receive_share: float

    def to_json(self) -> dict[str, Any]:
        return {"latency_ms": self.latency_ms, "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth,
                "receive_share": self.receive_share}

    @classmethod
    def from_json(cls, data: Any, key: str) -> Transfer:
        d = _fields(data, key, ("latency_ms", "bandwidth", "receive_share"))
        return cls(_number(d["latency_ms"], f"{key}.latency_ms"),
                   _number(d["bandwidth"], f"{key}.bandwidth", optional=True),
                   _number(d["receive_share"], f"{key}.receive_share"))


StageCalls = Mapping[str, Mapping[str, Phases]]
_KEYS = ("harness", "stage_calls", "recompute_call_ms", "recompute_ratio", "sequence", "loss", "transfer",
         "rank_compute_slowdown")


@dataclass(frozen=True)
class Corrections:
    """Every correction a profile measured ([Note: one profile, two runtimes]); the defaults
    are "not measured" (no call cost, recompute ratio 1, no loss, no transfer)."""

    harness: Phases | None = None
    stage_calls: StageCalls = field(default_factory=dict)  # runtime -> schedule -> call cost
    recompute_call_ms: float = 0.0  # per stage and recomputed micro-batch
    recompute_ratio: float = 1.0
    sequence: InSequence | None = None
    loss: LossCost | None = None
    transfer: Transfer | None = None
    rank_compute_slowdown: float | None = None

    def __post_init__(self) -> None:
        for runtime, calls in self.stage_calls.items():
            if runtime not in RUNTIMES:
                raise ProfileError(f"corrections.stage_calls has unknown runtime {runtime!r} (one of "
                                   f"{list(RUNTIMES)}); {_RERUN}")
            for schedule, phases in calls.items():
                if schedule not in SCHEDULES:
                    raise ProfileError(f"corrections.stage_calls.{runtime} has unknown schedule {schedule!r} "
                                       f"(one of {list(SCHEDULES)}); {_RERUN}")
                phases.check(f"corrections.stage_calls.{runtime}.{schedule}")
        _number(self.recompute_call_ms, "corrections.recompute_call_ms")
        _number(self.recompute_ratio, "corrections.recompute_ratio")
        if self.rank_compute_slowdown is not None:
            _number(self.rank_compute_slowdown, "corrections.rank_compute_slowdown")

    # --- reading ----------------------------------------------------------------------------
    def default_runtime(self) -> str:
        """The runtime a plan is for unless told: the distributed one where anything of it was
        measured (its calls, the transfer, the ranks' slowdown), else executor.GPipe."""
        measured = "distributed" in self.stage_calls or self.transfer is not None
        return "distributed" if measured or self.rank_compute_slowdown is not None else "gpipe"

    def call_for(self, runtime: str, schedule: str) -> Phases:
        """``runtime``'s call cost under ``schedule``: the first measured of
        :func:`call_fallbacks`; nothing measured: zero."""
        calls = self.stage_calls.get(runtime, {})
        for name in call_fallbacks(schedule):
            if name in calls:
                return calls[name]
        return Phases(0.0, 0.0)

    def for_runtime(self, runtime: str) -> Corrections:
        """These corrections as ``runtime`` sees them: its call costs only, the transfer and the
        slowdown only for the distributed runtime ([Note: one profile, two runtimes])."""
        if runtime not in RUNTIMES:
            raise ProfileError(f"runtime={runtime!r} is unknown; use one of {list(RUNTIMES)} (gpipe: "
                               "executor.GPipe in one process, distributed: torch.distributed.pipelining)")
        calls = self.stage_calls.get(runtime)
        if calls is None and runtime == "distributed" and "gpipe" in self.stage_calls:
            warnings.warn("autopipe: the profile measured no call cost of the distributed runtime, so the plan "
                          "uses executor.GPipe's in-process one; profile with comm=True (autopipe profile "
                          "--comm) to measure it", UserWarning, stacklevel=3)
            calls = self.stage_calls["gpipe"]
        distributed = runtime == "distributed"
        return dataclasses.replace(self, stage_calls={runtime: dict(calls or {})},
                                   transfer=self.transfer if distributed else None,
                                   rank_compute_slowdown=self.rank_compute_slowdown if distributed else None)

    def at_rows(self, rows: int, base: int) -> Corrections:
        """At a micro-batch of ``rows`` rows instead of ``base``: the loss scales with the rows
        ([Note: micro-batch scaling] in autopipe/core/scaling.py)."""
        if self.loss is None or rows == base or base <= 0:
            return self
        return dataclasses.replace(self, loss=dataclasses.replace(self.loss, micro_batch_size=base).scaled(rows))

    # --- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The ``"corrections"`` object of a profile's JSON side file: every key, null where
        not measured."""
        return {
            "harness": None if self.harness is None else self.harness.to_json(),
            "stage_calls": {r: {s: p.to_json() for s, p in calls.items()} for r, calls in self.stage_calls.items()},
            "recompute_call_ms": self.recompute_call_ms,
            "recompute_ratio": self.recompute_ratio,
            "sequence": None if self.sequence is None else self.sequence.to_json(),
            "loss": None if self.loss is None else self.loss.to_json(),
            "transfer": None if self.transfer is None else self.transfer.to_json(),
            "rank_compute_slowdown": self.rank_compute_slowdown,
        }

    @classmethod
    def from_json(cls, data: Any, key: str = "corrections") -> Corrections:
        """From :meth:`to_json`'s form; a missing or unknown key is a ProfileError naming it."""
        d = _fields(data, key, _KEYS)
        calls = d["stage_calls"]
        if not isinstance(calls, Mapping) or not all(isinstance(c, Mapping) for c in calls.values()):
            raise ProfileError(f"{key}.stage_calls must map runtime -> schedule -> {{fwd_ms, bwd_ms}}, got "
                               f"{calls!r}; {_RERUN}")
        slowdown = d["rank_compute_slowdown"]
        return cls(
            harness=None if d["harness"] is None else Phases.from_json(d["harness"], f"{key}.harness"),
            stage_calls={str(r): {str(s): Phases.from_json(p, f"{key}.stage_calls.{r}.{s}") for s, p in c.items()}
                         for r, c in calls.items()},
            recompute_call_ms=_number(d["recompute_call_ms"], f"{key}.recompute_call_ms"),
            recompute_ratio=_number(d["recompute_ratio"], f"{key}.recompute_ratio"),
            sequence=None if d["sequence"] is None else InSequence.from_json(d["sequence"], f"{key}.sequence"),
            loss=None if d["loss"] is None else LossCost.from_json(d["loss"], f"{key}.loss"),
            transfer=None if d["transfer"] is None else Transfer.from_json(d["transfer"], f"{key}.transfer"),
            rank_compute_slowdown=None if slowdown is None else _number(slowdown, f"{key}.rank_compute_slowdown"),
        )

    @classmethod
    def from_legacy_meta(cls, meta: Mapping[str, Any]) -> Corrections:
        """From the flat ``meta`` keys of profiles saved before corrections had their own object
        (an absent key: not measured; ``autopipe profile --comm`` kept the distributed runtime's
        calls as ``stage_call_*`` and executor.GPipe's as ``gpipe_call_*``)."""
        def num(key: str, default: float | None = None) -> float | None:
            return default if meta.get(key) is None else _number(meta[key], f"meta[{key!r}]")

        def phases(prefix: str) -> Phases | None:
            fwd, bwd = num(f"{prefix}_fwd_ms"), num(f"{prefix}_bwd_ms")
            return None if fwd is None and bwd is None else Phases(fwd or 0.0, bwd or 0.0)

        # the flat keys described one runtime: the distributed one where --comm measured it
        calls: dict[str, dict[str, Phases]] = {}
        main = phases("stage_call")
        schedules = {s: p for s in _LEGACY_SCHEDULES if (p := phases(f"stage_call_{s}")) is not None}
        if meta.get("stage_call_of") == "DistributedPipeline" or schedules:
            calls["distributed"] = {**({} if main is None else {"gpipe": main}), **schedules}
            main = phases("gpipe_call")
        if main is not None:
            calls["gpipe"] = {"gpipe": main}
        seq_fwd, seq_bwd = num("sequence_fwd_scale"), num("sequence_bwd_scale")
        loss = phases("loss")
        latency = num("comm_latency_ms")
        return cls(
            harness=phases("harness"),
            stage_calls=calls,
            recompute_call_ms=num("recompute_call_ms", 0.0) or 0.0,
            recompute_ratio=num("recompute_ratio", 1.0) or 0.0,
            sequence=None if seq_fwd is None and seq_bwd is None else InSequence(
                seq_fwd or 1.0, seq_bwd or 1.0, int(num("sequence_rounds", 0.0) or 0)),
            loss=None if loss is None else LossCost(loss.fwd_ms, loss.bwd_ms, int(
                num("loss_micro_batch_size") or num("micro_batch_size", 0.0) or 0)),
            transfer=None if latency is None and meta.get("comm_bandwidth") is None else Transfer(
                latency or 0.0, num("comm_bandwidth") or math.inf, num("comm_receive_share", 0.0) or 0.0),
            rank_compute_slowdown=num("rank_compute_slowdown"),
        )


_LEGACY = {"harness_fwd_ms", "harness_bwd_ms", "stage_call_fwd_ms", "stage_call_bwd_ms", "stage_call_of",
           "gpipe_call_fwd_ms", "gpipe_call_bwd_ms", "recompute_call_ms", "recompute_ratio", "sequence_fwd_scale",
           "sequence_bwd_scale", "sequence_rounds", "loss_fwd_ms", "loss_bwd_ms", "loss_micro_batch_size",
           "comm_latency_ms", "comm_bandwidth", "comm_receive_share", "rank_compute_slowdown",
           *(f"stage_call_{s}_{p}_ms" for s in _LEGACY_SCHEDULES for p in ("fwd", "bwd"))}


def is_legacy_key(key: str) -> bool:
    """Whether ``key`` is a flat ``meta`` key that :meth:`Corrections.from_legacy_meta` reads."""
    return key in _LEGACY
