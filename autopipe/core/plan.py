"""The Plan: which layers run on which stage, and what that is predicted to cost.

A Plan is a frozen, JSON-serialisable value. The partitioners return one; ``autopipe build``
reads one and calls :meth:`Plan.check` against the traced graph before splitting the model.
Everything numeric in it comes from ``autopipe.core.cost`` (per-stage time and memory) and
``autopipe.core.simulator`` (iteration time, bubble, per-stage and per-device peak memory under
the plan's schedule); ``autopipe.core.plan_text`` puts it in words.

[Note: plan fields over time] is in autopipe/core/plan_checks.py: older plans load. A plan made
for another micro-batch than the profile's ([Note: micro-batch scaling] in
autopipe/core/scaling.py) cannot know the full fingerprint of that shape without tracing: its
fingerprint is ``*.STRUCTURE`` and :meth:`Plan.check` compares the structure and the micro-batch
rows instead.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from autopipe.core import plan_text
from autopipe.core.atomic_files import atomic_write_text
from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    StageCost,
    layer_work,
    lower_bound,
    resolve_devices,
    stage_costs,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.estimated import estimate_text
from autopipe.core.plan_checks import OPTIONAL, check_types, renamed
from autopipe.core.plan_fit import assign_stages, check_plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate_stages
from autopipe.errors import PlanError
from executor.decision import Decision
from executor.spec import merge_rules, recomputed_microbatches

__all__ = ["Plan", "SolverInfo", "Alternative", "PLAN_FORMAT"]

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
class Alternative:
    """A configuration a search weighed against the chosen one: its stage count, micro-batches,
    schedule and recomputation, simulated iteration (ms), bottleneck (ms), the highest device
    peak (bytes) and, when it was not a contender, why (``note``)."""

    stages: int
    chunks: int
    schedule: str
    recompute: str | list[str]
    iteration_time: float
    bottleneck: float
    memory: int
    note: str = ""
    data_parallel: int = 1  # replicas of the pipeline ([Note: pipeline x data parallel])
    tensor_parallel: int = 1  # ranks per stage ([Note: the mesh] in solvers/tensor_parallel_search.py)


@dataclass(frozen=True)
class Plan:
    """A partition of a profile's layers into pipeline stages, with its predicted cost.

    ``stages[s]`` lists the layers of stage s (in topological order); ``devices[s]`` is where it
    runs. Times are ms per micro-batch (``stage_times``, ``bottleneck``, ``lower_bound``) or per
    iteration (``iteration_time``, simulated GPipe); memory is bytes. ``breakdown[s]`` splits
    stage s's time into forward, backward, recompute and transfer (for stacked bar plots).
    ``recompute`` is one mode, or one per stage (``stage_recompute`` always gives the list).
    What it decides, apart from what it predicts, is :attr:`decision`: the one value the runtimes
    take ([Note: a plan's decision] in executor/decision.py).
    """

    stages: list[list[str]]
    devices: list[DeviceSpec]
    chunks: int
    recompute: str | list[str]
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
    batch_size: int | None = None  # the batch and the micro-batch rows, when recorded
    micro_batch_size: int | None = None
    schedule: str = "gpipe"
    alternatives: list[Alternative] = field(default_factory=list)
    device_memory: dict[str, int] = field(default_factory=dict)  # peak per device, all its stages
    data_parallel: int = 1  # replicas of this pipeline ([Note: pipeline x data parallel])
    dp_mode: str = "ddp"  # how replicas share gradients: "ddp" (all-reduce) or "fsdp" (sharded)
    recompute_layers: list[str] = field(default_factory=list)  # [Note: recomputed layers]
    runtime: str | None = None  # whose measured costs it was planned with (None: unrecorded)
    precision: str = "fp32"  # its profile's, what its costs predict ([Note: mixed precision memory])
    skipped_schedules: dict[str, str] = field(default_factory=dict)  # a search's, each with why
    merge_backward: str = "unwaited"  # zero-bubble schedules: [Note: adjacent I and W]
    estimated_from: str | None = None  # the sheet of an estimated profile ([Note: estimated or measured])
    tensor_parallel: int = 1  # ranks that split each stage's layers ([Note: tensor-parallel cost])
    segment_starts: list[str] = field(default_factory=list)  # [Note: recomputed layers]: kept apart
    sequence_parallel: bool = False  # TP splits the replicated layers by sequence ([Note: sequence parallelism])

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_stages(
        cls,
        profile: Profile,
        stages: Sequence[Sequence[str]],
        *,
        devices: Sequence[DeviceSpec | str] | None = None,
        chunks: int = 8,
        recompute: str | Sequence[str] = "except_last",
        optimizer: str = "adam",
        bandwidth: float | None = 10e9,
        ties: str = "share",
        memory_limit: int | str | None = None,
        method: str = "manual",
        solver: SolverInfo | None = None,
        schedule: str = "gpipe",
        alternatives: Sequence[Alternative] = (),
        data_parallel: int = 1,
        dp_mode: str = "ddp",
        recompute_layers: Sequence[str] = (),
        runtime: str | None = None,
        skipped_schedules: dict[str, str] | None = None,
        merge_backward: str | None = None,
        segment_starts: Sequence[str] = (),
    ) -> Plan:
        """Evaluate a given split (a hand-made one, a baseline's, or a solver's) on ``profile``.

        ``recompute`` is one mode or a list of one mode per stage; ``schedule`` one of
        executor.spec.SCHEDULES (``interleaved1f1b`` cycles the stages over the distinct device
        names). ``data_parallel`` replicas of it, synced as ``dp_mode`` says, each run
        ``profile``'s micro-batch ([Note: pipeline x data parallel] in autopipe/core/data_parallel.py).
        ``recompute_layers``: layers recomputed in the backward (consecutive ones as one
        segment, but at each of ``segment_starts``), in stages of mode ``never`` ([Note: recomputed
        layers] in autopipe/core/recomputed_layers.py). ``runtime``: whose measured costs to plan with
        (default: the profile's, [Note: one profile, two runtimes] in autopipe/core/corrections.py).
        ``skipped_schedules``: what a search could not weigh, schedule -> why (plan.explain() says it).
        ``merge_backward``: which adjacent halves of a zero-bubble schedule's split backward run
        whole (executor.spec.MERGE_RULES, [Note: adjacent I and W]); default: under a zero-bubble
        schedule the rule whose simulated iteration is shorter ("unwaited" on a tie), else
        "unwaited".
        Raises PlanError when ``stages`` does not cover every layer exactly once, a
        stage is empty, or an edge of the graph runs from a later stage back to an earlier one.
        """
        specs = resolve_devices(len(stages), devices, memory_limit)
        modes = CostOptions(chunks, _one(recompute), optimizer, bandwidth, ties, schedule).modes(len(stages))
        rules = (merge_backward,) if merge_backward is not None else merge_rules(schedule)
        layers = profile.layers
        where = assign_stages(stages, layers, profile.edges, "the profile")
        chosen = profile.corrections.default_runtime() if runtime is None else runtime
        costs = LayerCosts.from_profile(profile, chosen)
        tried = []
        for rule in rules:  # the first of the fastest: "unwaited" on a tie
            options = CostOptions(chunks, tuple(modes), optimizer, bandwidth, ties, schedule,
                                  data_parallel, dp_mode, tuple(recompute_layers), rule, tuple(segment_starts))
            breakdown = stage_costs(costs, [where[n] for n in layers], specs, options)
            tried.append((simulate_stages(breakdown, chunks=chunks, recompute=modes, schedule=schedule,
                                          ms_per_byte=options.ms_per_byte, devices=[d.name for d in specs],
                                          merge=rule), rule, breakdown))
        sim, rule, breakdown = min(tried, key=lambda t: t[0].iteration_time)
        least = min(recomputed_microbatches(mode, chunks) for mode in modes)
        work = layer_work(costs.fwd, costs.bwd, least, chunks, costs.recompute_ratio)
        big = int(np.argmax(work))
        lower = lower_bound(work, [d.speed for d in specs], costs.call_ms(schedule))
        times = [c.time_ms for c in breakdown]
        ordered = [[n for n in layers if where[n] == s] for s in range(len(stages))]
        replica_batch = _int_or_none(profile.meta.get("batch_size"))
        rows = _int_or_none(profile.meta.get("micro_batch_size"))
        if rows is not None and _int_or_none(profile.meta.get("chunks")) not in (None, chunks):
            replica_batch = rows * chunks  # the profile's micro-batch, ``chunks`` times: its batch
        return cls(
            stages=ordered, devices=specs, chunks=chunks, recompute=_one(modes), method=method,
            stage_times=times, stage_memory=[c.memory_bytes for c in breakdown],
            bottleneck=max(times), iteration_time=sim.iteration_time, lower_bound=lower,
            bubble_fraction=sim.bubble_fraction, peak_memory=sim.peak_memory,
            breakdown=breakdown, solver=solver or SolverInfo(), fingerprint=profile.fingerprint,
            optimizer=optimizer, bandwidth=bandwidth, ties=ties,
            largest_layer=(layers[big], float(work[big])),
            batch_size=None if replica_batch is None else replica_batch * data_parallel,
            micro_batch_size=_int_or_none(profile.meta.get("micro_batch_size")),
            schedule=schedule, alternatives=list(alternatives), device_memory=sim.device_memory,
            data_parallel=data_parallel, dp_mode=dp_mode,
            recompute_layers=[n for n in layers if n in set(recompute_layers)], runtime=chosen,
            precision=costs.precision, skipped_schedules=dict(skipped_schedules or {}),
            merge_backward=rule, estimated_from=estimate_text(profile.meta),
            segment_starts=[n for n in layers if n in set(segment_starts)],
        )

    # --- use --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def checkpoint(self) -> str | list[str]:
        """``recompute``'s old name, until the next release ([Note: recompute, not checkpoint] in
        executor/spec.py)."""
        warnings.warn("plan.checkpoint is now plan.recompute; checkpoint will be removed in the "
                      "next release", DeprecationWarning, stacklevel=2)
        return self.recompute

    @property
    def stage_recompute(self) -> list[str]:
        """Each stage's recompute mode ([Note: per-stage recomputation] in executor/spec.py)."""
        return [self.recompute] * self.num_stages if isinstance(self.recompute, str) else list(self.recompute)

    @property
    def highest_memory(self) -> int:
        """The highest predicted peak of any device, its stages together (bytes)."""
        return max(self.device_memory.values(), default=max(self.peak_memory))

    def as_alternative(self, note: str) -> Alternative:
        """This plan as one a search weighed against the plan it chose, with why it lost."""
        return Alternative(self.num_stages, self.chunks, self.schedule, self.recompute, self.iteration_time,
                           self.bottleneck, self.highest_memory, note, self.data_parallel, self.tensor_parallel)

    @property
    def build_memory(self) -> dict[str, int]:
        """Per device, its stages' parameters and buffers: a meta-device build's peak ([Note: the build's memory])."""
        names = [d.name for d in self.devices]
        return {n: sum(b.build_bytes for d, b in zip(names, self.breakdown, strict=True) if d == n) for n in names}

    @property
    def decision(self) -> Decision:
        """What this plan decides, as the one value the runtimes take ([Note: a plan's decision]
        in executor/decision.py); the rest of the plan is its prediction."""
        return Decision(tuple(tuple(s) for s in self.stages), self.chunks, tuple(self.stage_recompute),
                        devices=tuple(d.name for d in self.devices), schedule=self.schedule,
                        merge_backward=self.merge_backward, data_parallel=self.data_parallel,
                        dp_mode=self.dp_mode, recompute_layers=tuple(self.recompute_layers),
                        precision=self.precision)

    @property
    def cost_options(self) -> CostOptions:
        """The options every cost of this plan was computed with."""
        return CostOptions(self.chunks, _one(self.recompute), self.optimizer, self.bandwidth,
                           self.ties, self.schedule, self.data_parallel, self.dp_mode,
                           tuple(self.recompute_layers), self.merge_backward, tuple(self.segment_starts))

    def profile_for(self, profile: Profile) -> Profile:
        """``profile`` checked against this plan and, when the plan was made for another
        micro-batch size, scaled to it ([Note: micro-batch scaling]): what the plan's costs are
        recomputed from, as the plan's runtime sees it ([Note: one profile, two runtimes]) and one
        rank of its TP group runs it ([Note: tensor-parallel cost])."""
        from autopipe.core.scaling import profile_at
        from autopipe.core.tensor_parallel import at_degree, tp_link

        self.check(profile.layers, profile.fingerprint)
        profile = profile.for_runtime(self.runtime)
        if self.tensor_parallel > 1:  # one rank of the TP group ([Note: tensor-parallel cost])
            profile = at_degree(profile, self.tensor_parallel, tp_link(profile, self.bandwidth), self.sequence_parallel)
        rows = self.micro_batch_size
        if rows is not None and profile.meta.get("micro_batch_size") not in (None, rows):
            profile = profile_at(profile, rows, batch_size=self.batch_size, chunks=self.chunks)
        return profile

    def check(self, layers: Sequence[str], fingerprint: str | None, *,
              micro_batch_size: int | None = None) -> None:
        """Raise PlanError unless this plan was made for a graph with these layers; a fingerprint
        mismatch says whether the model or the micro-batch shape differs (``micro_batch_size``:
        the rows of the graph's micro-batch, named in the message when given)."""
        check_plan(self, layers, fingerprint, micro_batch_size=micro_batch_size)

    def explain(self) -> str:
        """What was chosen, the bottleneck against the lower bound, what limits the plan (memory
        or time) and, after a search, the next best alternatives with their predicted times."""
        return plan_text.explain(self)

    def spans(self) -> list[str]:
        """Each stage's layers as ``first .. last`` (whole names, never cut)."""
        return [names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}" for names in self.stages]

    def table(self) -> str:
        """A per-stage table: layers, time, memory, share of the summed time, recomputation."""
        return plan_text.table(self)

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
        data = renamed(data)
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n not in OPTIONAL]  # older plans lack them
        if missing:
            raise PlanError(f"{where} lacks key(s) {missing}; re-run `autopipe partition ...`")
        try:
            kw = {n: data[n] for n in names if n in data}
            if kw.get("method") == "dp":  # the exact solver's name before "exact"
                kw["method"] = "exact"
            kw["devices"] = [DeviceSpec(**d) for d in data["devices"]]
            kw["breakdown"] = [StageCost(**b) for b in data["breakdown"]]
            kw["solver"] = SolverInfo(**data.get("solver", {}))
            kw["largest_layer"] = tuple(data.get("largest_layer", ("", 0.0)))
            kw["alternatives"] = [Alternative(**renamed(a)) for a in data.get("alternatives", [])]
            kw["device_memory"] = dict(data.get("device_memory", {}))
            plan = cls(**kw)
            check_types(plan)
        except (TypeError, ValueError, AttributeError) as err:
            raise PlanError(f"{where} has a malformed field: {err}; re-run `autopipe partition ...`") from None
        return plan


def _one(recompute: str | Sequence[str]) -> str | list[str]:
    """One mode when every stage has it (the form older plans and readers know), else the list."""
    if isinstance(recompute, str):
        return recompute
    modes = list(recompute)
    return modes[0] if modes and all(m == modes[0] for m in modes) else modes


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
