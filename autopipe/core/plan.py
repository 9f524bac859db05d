"""The Plan: which layers run on which stage, and what that is predicted to cost.

A Plan is a frozen, JSON-serialisable value. The partitioners return one; ``autopipe build``
reads one and calls :meth:`Plan.check` against the traced graph before splitting the model.
Everything numeric in it comes from ``autopipe.core.cost`` (per-stage time and memory) and
``autopipe.core.simulator`` (iteration time, bubble, per-stage peak memory under GPipe).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from autopipe.core.cost import (
    CostOptions,
    DeviceSpec,
    LayerCosts,
    StageCost,
    layer_work,
    lower_bound,
    resolve_devices,
    stage_costs,
)
from autopipe.core.files import atomic_write_text
from autopipe.core.profile_table import Profile, fingerprint_mismatch, micro_batch_text
from autopipe.core.simulator import simulate_stages
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError, PlanError
from executor.spec import recomputed_microbatches

__all__ = ["Plan", "SolverInfo", "PLAN_FORMAT", "assign_stages"]

PLAN_FORMAT = "autopipe-plan/1"


@dataclass(frozen=True)
class SolverInfo:
    """How the split was found: solver status, objective (ms), best bound (ms), relative gap."""

    status: str = "evaluated"
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A partition of a profile's layers into pipeline stages, with its predicted cost.

    ``stages[s]`` lists the layers of stage s (in topological order); ``devices[s]`` is where it
    runs. Times are ms per micro-batch (``stage_times``, ``bottleneck``, ``lower_bound``) or per
    iteration (``iteration_time``, simulated GPipe); memory is bytes. ``breakdown[s]`` splits
    stage s's time into forward, backward, recompute and transfer (for stacked bar plots).
    """

    stages: list[list[str]]
    devices: list[DeviceSpec]
    chunks: int
    checkpoint: str
    method: str
    stage_times: list[float]
    stage_memory: list[int]
    bottleneck: float
    iteration_time: float
    lower_bound: float
    bubble_fraction: float
    peak_memory: list[int]
    breakdown: list[StageCost]
    solver: SolverInfo = field(default_factory=SolverInfo)
    fingerprint: str | None = None
    optimizer: str = "adam"
    bandwidth: float | None = 10e9
    ties: str = "share"
    largest_layer: tuple[str, float] = ("", 0.0)
    batch_size: int | None = None  # the profile's batch and micro-batch rows, when recorded
    micro_batch_size: int | None = None

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_stages(
        cls,
        profile: Profile,
        stages: Sequence[Sequence[str]],
        *,
        devices: Sequence[DeviceSpec | str] | None = None,
        chunks: int = 8,
        checkpoint: str = "except_last",
        optimizer: str = "adam",
        bandwidth: float | None = 10e9,
        ties: str = "share",
        memory_limit: int | str | None = None,
        method: str = "manual",
        solver: SolverInfo | None = None,
    ) -> Plan:
        """Evaluate a given split (a hand-made one, a baseline's, or a solver's) on ``profile``.

        Raises PlanError when ``stages`` does not cover every layer exactly once, a stage is
        empty, or an edge of the graph runs from a later stage back to an earlier one.
        """
        options = CostOptions(chunks, checkpoint, optimizer, bandwidth, ties)
        specs = resolve_devices(len(stages), devices, memory_limit)
        layers = profile.layers
        where = assign_stages(stages, layers, profile.edges, "the profile")
        costs = LayerCosts.from_profile(profile)
        breakdown = stage_costs(costs, [where[n] for n in layers], specs, options)
        sim = simulate_stages(breakdown, chunks=chunks, checkpoint=checkpoint,
                              ms_per_byte=options.ms_per_byte, devices=[d.name for d in specs])
        work = layer_work(costs.fwd, costs.bwd, recomputed_microbatches(checkpoint, chunks), chunks)
        big = int(np.argmax(work))
        lower = lower_bound(work, [d.speed for d in specs])
        times = [c.time_ms for c in breakdown]
        ordered = [[n for n in layers if where[n] == s] for s in range(len(stages))]
        return cls(
            stages=ordered, devices=specs, chunks=chunks, checkpoint=checkpoint, method=method,
            stage_times=times, stage_memory=[c.memory_bytes for c in breakdown],
            bottleneck=max(times), iteration_time=sim.iteration_time, lower_bound=lower,
            bubble_fraction=sim.bubble_fraction, peak_memory=sim.peak_memory,
            breakdown=breakdown, solver=solver or SolverInfo(), fingerprint=profile.fingerprint,
            optimizer=optimizer, bandwidth=bandwidth, ties=ties,
            largest_layer=(layers[big], float(work[big])),
            batch_size=_int_or_none(profile.meta.get("batch_size")),
            micro_batch_size=_int_or_none(profile.meta.get("micro_batch_size")),
        )

    # --- use --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def check(self, layers: Sequence[str], fingerprint: str | None, *,
              micro_batch_size: int | None = None) -> None:
        """Raise PlanError unless this plan was made for a graph with these layers; a fingerprint
        mismatch says whether the model or the micro-batch shape differs (``micro_batch_size``:
        the rows of the graph's micro-batch, named in the message when given)."""
        differs = fingerprint_mismatch(self.fingerprint, fingerprint)
        head = f"plan was made for graph fingerprint {self.fingerprint} but this graph has {fingerprint}"
        if differs == "model":
            raise PlanError(f"{head}: the plan is for another model (its layers or parameter shapes "
                            f"differ); re-run autopipe profile and autopipe partition for this model")
        mine = micro_batch_text({"micro_batch_size": self.micro_batch_size,
                                 "batch_size": self.batch_size, "chunks": self.chunks})
        this = f", this one's {micro_batch_size} rows" if micro_batch_size is not None else ""
        if differs == "shape":
            raise PlanError(
                f"{head}: same model, another micro-batch shape (the plan's micro-batch is "
                f"{mine}{this}; a micro-batch is the first ceil(batch / chunks) rows); use the "
                f"plan's batch size and chunks, or re-run autopipe profile and autopipe partition "
                f"for this batch and chunks"
            )
        if differs == "graph":
            known = f"; the plan's micro-batch is {mine}{this}" if self.micro_batch_size else ""
            fix = "use the plan's batch size and chunks, or " if self.micro_batch_size else ""
            raise PlanError(f"{head} (another model or micro-batch shape{known}); {fix}re-run "
                            f"autopipe profile and autopipe partition for this model/batch")
        _check_layers({n for names in self.stages for n in names}, list(layers), "the graph")

    def explain(self) -> str:
        """One paragraph: the bottleneck, how far it is from the lower bound, and what limits it."""
        k = self.num_stages
        s = int(np.argmax(self.stage_times))
        names = self.stages[s]
        total = sum(self.stage_times)
        span = self.spans()[s]
        big_name, big_ms = self.largest_layer
        parts = [
            f"{k} stage(s) by {self.method}: stage {s} ({span}, {len(names)} layers on "
            f"{self.devices[s].name}) is the bottleneck at {self.bottleneck:.3f} ms per micro-batch, "
            f"{100 * self.stage_times[s] / total:.0f}% of the summed stage time; the lower bound "
            f"max(T/K, largest layer) is {self.lower_bound:.3f} ms (largest layer {big_name!r}: "
            f"{big_ms:.3f} ms), so the plan is {100 * (self.bottleneck / self.lower_bound - 1):.1f}% "
            f"above it." if self.lower_bound > 0 else
            f"{k} stage(s) by {self.method}: every layer costs 0 ms.",
            f"Simulated GPipe iteration with {self.chunks} micro-batches: {self.iteration_time:.3f} ms "
            f"({100 * self.bubble_fraction:.0f}% bubble).",
        ]
        parts.append(f"Limited by {self._limit(s)}.")
        if self.solver.gap is not None:
            parts.append(f"Solver status {self.solver.status}, gap {100 * self.solver.gap:.2f}%.")
        return " ".join(parts)

    def _limit(self, s: int) -> str:
        b = self.breakdown[s]
        over = [i for i, (mem, d) in enumerate(zip(self.stage_memory, self.devices, strict=True))
                if d.memory is not None and mem > d.memory]
        if over:
            i = over[0]
            return (f"memory: stage {i} needs {format_bytes(self.stage_memory[i])} but "
                    f"{self.devices[i].name} has {format_bytes(self.devices[i].memory)}")
        if self.bottleneck <= 1.005 * self.lower_bound:
            return "nothing but the total work: the split is balanced; add stages or faster devices"
        if self.largest_layer[1] / max(d.speed for d in self.devices) >= 0.9 * self.bottleneck:
            return (f"the big layer {self.largest_layer[0]!r}: no split can go below it; "
                    f"split that layer or use fewer stages")
        if b.transfer_ms > 0.1 * b.time_ms:
            return (f"transfers: {b.transfer_ms:.3f} ms ({100 * b.transfer_ms / b.time_ms:.0f}%) of "
                    f"stage {s} is sending activations and gradients; raise bandwidth or cut at "
                    f"thinner activations")
        tight = [i for i, (mem, d) in enumerate(zip(self.stage_memory, self.devices, strict=True))
                 if d.memory is not None and mem > 0.9 * d.memory]
        if tight:
            return (f"memory: stage {tight[0]} uses {100 * self.stage_memory[tight[0]] / (self.devices[tight[0]].memory or 1):.0f}% "
                    f"of its device, which keeps layers off it")
        return "layer granularity: whole layers cannot be balanced more evenly"

    def spans(self) -> list[str]:
        """Each stage's layers as ``first .. last`` (whole names, never cut)."""
        return [names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}" for names in self.stages]

    def table(self) -> str:
        """A per-stage table: layers, time, memory and share of the summed time."""
        total = sum(self.stage_times) or 1.0
        spans = self.spans()
        wide = max(len("first .. last"), *(len(x) for x in spans))
        dev = max(len("device"), *(len(d.name) for d in self.devices))
        rows = [f"{'stage':>5}  {'device':<{dev}} {'layers':>6}  {'first .. last':<{wide}} {'time ms':>9} "
                f"{'fwd':>8} {'bwd':>8} {'recomp':>8} {'xfer':>8} {'memory':>10}  {'share':>5}"]
        for s, names in enumerate(self.stages):
            b = self.breakdown[s]
            rows.append(
                f"{s:>5}  {self.devices[s].name:<{dev}} {len(names):>6}  {spans[s]:<{wide}} "
                f"{self.stage_times[s]:>9.3f} {b.fwd_ms:>8.3f} {b.bwd_ms:>8.3f} {b.recompute_ms:>8.3f} "
                f"{b.transfer_ms:>8.3f} {format_bytes(self.stage_memory[s]):>10}  "
                f"{100 * self.stage_times[s] / total:>4.0f}%"
            )
        return "\n".join(rows)

    # --- disk -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, **asdict(self)}

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the plan as JSON; refuses to replace a file unless ``overwrite=True``."""
        p = Path(path)
        if p.exists() and not overwrite:
            raise PlanError(f"{p} already exists: refusing to overwrite a saved plan; "
                            f"pass --force / overwrite=True or choose another name")
        atomic_write_text(p, json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan saved by :meth:`save`; PlanError names what is wrong with the file."""
        p = Path(path)
        if not p.exists():
            raise PlanError(f"{p} does not exist; run `autopipe partition ... --out {p}` first")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            line = getattr(err, "lineno", "?")
            raise PlanError(f"{p} is not valid JSON (line {line}): {getattr(err, 'msg', err)}; "
                            f"re-run `autopipe partition ...`") from None
        return cls.from_dict(data, where=str(p))

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{where} is not an autopipe plan (expected format {PLAN_FORMAT!r}); "
                            f"re-run `autopipe partition ...`")
        names = [f.name for f in fields(cls)]
        optional = ("solver", "largest_layer", "batch_size", "micro_batch_size")  # older plans lack them
        missing = [n for n in names if n not in data and n not in optional]
        if missing:
            raise PlanError(f"{where} lacks key(s) {missing}; re-run `autopipe partition ...`")
        try:
            kw = {n: data[n] for n in names if n in data}
            kw["devices"] = [DeviceSpec(**d) for d in data["devices"]]
            kw["breakdown"] = [StageCost(**b) for b in data["breakdown"]]
            kw["solver"] = SolverInfo(**data.get("solver", {}))
            kw["largest_layer"] = tuple(data.get("largest_layer", ("", 0.0)))
            plan = cls(**kw)
            _check_types(plan)
        except (TypeError, ValueError, AttributeError) as err:
            raise PlanError(f"{where} has a malformed field: {err}; re-run `autopipe partition ...`") from None
        return plan


def _check_types(plan: Plan) -> None:
    k = len(plan.stages)
    if not (isinstance(plan.stages, list) and all(
            isinstance(s, list) and s and all(isinstance(n, str) for n in s) for s in plan.stages)):
        raise TypeError("'stages' must be a list of non-empty lists of layer names")
    for name in ("devices", "stage_times", "stage_memory", "peak_memory", "breakdown"):
        value = getattr(plan, name)
        if not isinstance(value, list) or len(value) != k:
            raise TypeError(f"{name!r} must be a list with one entry per stage ({k})")
    numbers = [*plan.stage_times, *plan.stage_memory, *plan.peak_memory, plan.bottleneck,
               plan.iteration_time, plan.lower_bound, plan.bubble_fraction]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers):
        raise TypeError("times and memory must be numbers")
    if not isinstance(plan.chunks, int) or plan.chunks < 1:
        raise TypeError(f"'chunks' must be an integer >= 1, got {plan.chunks!r}")
    for name in ("batch_size", "micro_batch_size"):
        value = getattr(plan, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TypeError(f"{name!r} must be an integer >= 1 or null, got {value!r}")
    CostOptions(plan.chunks, plan.checkpoint, plan.optimizer, plan.bandwidth, plan.ties)


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _check_layers(
    have: set[str], layers: Sequence[str], what: str, error: type[AutopipeError] = PlanError
) -> None:
    unknown = sorted(have - set(layers))
    missing = [n for n in layers if n not in have]
    if unknown:
        raise error(f"plan names {len(unknown)} layer(s) not in {what}, e.g. {unknown[:3]}; "
                    f"the plan is for another model: re-run autopipe partition")
    if missing:
        raise error(f"plan leaves {len(missing)} layer(s) of {what} unassigned, e.g. {missing[:3]}; "
                    f"the plan is for another model: re-run autopipe partition")


def assign_stages(
    stages: Sequence[Sequence[str]],
    layers: Sequence[str],
    edges: Iterable[tuple[str, str, Any]],
    what: str,
    error: type[AutopipeError] = PlanError,
) -> dict[str, int]:
    """Layer -> stage index, after checking that ``stages`` lists every layer exactly once, in
    non-empty stages, with no edge running from a later stage back to an earlier one."""
    if not stages:
        raise error("a plan needs at least one stage; got an empty stage list")
    where: dict[str, int] = {}
    for s, names in enumerate(stages):
        if not names:
            raise error(f"stage {s} of {len(stages)} is empty; every stage needs a layer")
        for name in names:
            if name in where:
                raise error(f"layer {name!r} is in stage {where[name]} and stage {s}; list it once")
            where[name] = s
    _check_layers(set(where), layers, what, error)
    for src, dst, _ in edges:
        if where[src] > where[dst]:
            raise error(
                f"edge {src!r} (stage {where[src]}) -> {dst!r} (stage {where[dst]}) runs backwards: "
                f"stages must follow the graph's order; move {dst!r} to stage >= {where[src]}"
            )
    return where
