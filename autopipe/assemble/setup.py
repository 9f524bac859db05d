"""The setup both pipelines share, written once: pipeline() (local.py) and distributed_pipeline()
(ranks.py) each call these in the same order.

    batch = example_batch(model, inputs, kwargs, chunks)  # the micro-batch graphs are keyed to
    graph = traced(model, batch, trace_kwargs)            # traced on that micro-batch
    given, mode = recompute_asked(recompute, plan, stages)  # to partition with, or to override
    modes = runtime_recompute(plan, given)                # what the runtime runs, plan first
    check_device_memory(plan, devices)                    # refused before anything is built

See [Note: graphs are keyed to the micro-batch] and [Note: a plan is a prediction for a
placement] in local.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopipe.core.plan import Plan
from autopipe.core.planned_precision import precision_mismatch
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.core.units import format_bytes
from autopipe.errors import BuildError
from autopipe.frontend.profiling.harness.inputs import micro_batch
from autopipe.frontend.tracing.counted_loss import uncounted_loss
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.frontend.tracing.keyword_inputs import split_keywords
from executor.errors import MicroBatchError
from executor.keywords import InputSignature
from executor.local.worker import normalize_device
from executor.model_loss import ModelLoss
from executor.packed import POSITIONS, as_rows, packed_sizes, split_packed
from executor.spec import check_precision, check_stage_recompute

__all__ = ["DEFAULT_PIPELINE_CHUNKS", "ExampleBatch", "example_batch", "traced", "recompute_asked", "check_runnable",
           "graph_signature", "graph_model_loss", "microbatch_inputs",
           "check_device_memory", "free_memory", "device_names", "plan_for_devices", "placement_warning",
           "partition_recompute", "runtime_recompute", "pipeline_precision", "warn_precision_mismatch",
           "check_profile_allocator"]

DEFAULT_PIPELINE_CHUNKS = 8  # pipeline() and distributed_pipeline() without a plan or chunks


def graph_signature(graph: LayerGraph) -> InputSignature:
    """The inputs ``graph`` takes: its positional ones, then its keyword inputs by name."""
    return InputSignature(graph.num_args - len(graph.keywords), graph.keywords)


def graph_model_loss(graph: LayerGraph, loss_fn: Callable[..., Any] | None = None) -> ModelLoss | None:
    """The model's own loss in ``graph``, counted per micro-batch (see counted_loss.py). Without
    ``loss_fn``, one warning line when the model returns a loss that cannot be counted."""
    if graph.loss is not None:
        return ModelLoss(graph.loss.leaf, graph.loss.count)
    why = "" if loss_fn is not None else uncounted_loss(graph.gm, graph.num_args)
    if why:
        warnings.warn(f"autopipe: the model's {why}, which cannot be counted per item: each "
                      "micro-batch's loss is weighted by its share of rows, right only for a mean "
                      "over rows; return a plain mean cross_entropy of labels that are inputs (no "
                      "weight=, reduction='mean'), or return the logits and pass loss_fn=",
                      UserWarning, stacklevel=3)
    return None


def device_names(devices: Sequence[str | torch.device | int]) -> list[str]:
    """Each device as the runtime names it (``"cpu:1"`` -> ``cpu``, ``"cuda"`` -> ``cuda:N``):
    the names a plan for these devices must carry for its simulation to group them right."""
    names = []
    for d in devices:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        usable = dev.type != "cuda" or torch.cuda.is_available()  # else GPipe refuses it later
        names.append(str(normalize_device(dev) if usable else dev))
    return names


def plan_for_devices(plan: Plan, devices: Sequence[str | torch.device | int]) -> Plan:
    """``plan`` re-evaluated for running on ``devices`` (one per stage): the same stages and
    per-stage costs, the devices' runtime names, and the iteration time, bubble and peaks that
    :func:`autopipe.simulate` predicts for them ([Note: a plan is a prediction for a placement]).
    ``plan`` itself when its stages share devices as these do: a simulation reads a device's
    name only to tell which stages share it, so a plan for ``["cuda", "cuda"]`` run on
    ``cuda:0`` twice predicts the same step under either name."""
    names = device_names(devices)
    if len(names) != len(plan.devices):
        raise BuildError(f"the plan has {len(plan.devices)} stages but {len(names)} devices were "
                         f"given; pass one device per stage")
    if _sharing([d.name for d in plan.devices]) == _sharing(names) and plan.schedule == "gpipe":
        return plan
    # executor.GPipe runs fill-drain: a plan made for another schedule is predicted as gpipe
    placed = dataclasses.replace(plan, schedule="gpipe", devices=[
        dataclasses.replace(d, name=n) for d, n in zip(plan.devices, names, strict=True)])
    sim = simulate(placed, schedule="gpipe")
    return dataclasses.replace(placed, iteration_time=sim.iteration_time,
                               bubble_fraction=sim.bubble_fraction, peak_memory=sim.peak_memory)


def _sharing(names: Sequence[str]) -> list[int]:
    """Which stages share a device: each stage's index of the first stage on its device."""
    return [names.index(n) for n in names]


def placement_warning(plan: Plan, placed: Plan) -> str:
    now = [d.name for d in placed.devices]
    shared = len(set(now)) < len(now)
    other = f" and schedule {plan.schedule!r} (executor.GPipe runs 'gpipe')" \
        if plan.schedule != "gpipe" else ""
    return (f"autopipe: the plan was made for devices {[d.name for d in plan.devices]}{other} but "
            f"the pipeline runs on {now}{' (stages on one device take turns)' if shared else ''}: "
            f"pipe.plan is re-evaluated for them, {placed.iteration_time:.3f} ms per iteration "
            f"instead of the plan's {plan.iteration_time:.3f} ms; partition with these devices "
            f"for a plan balanced for them")


def _modes(recompute: str | Sequence[str], stages: int, what: str) -> list[str]:
    try:
        return check_stage_recompute(recompute, stages)
    except ValueError as err:
        raise BuildError(f"{what}: {err}") from None


def _show(modes: list[str]) -> str:
    return repr(modes[0]) if len(set(modes)) == 1 else repr(modes)


def partition_recompute(recompute: str | Sequence[str] | None, stages: int) -> str:
    """The mode to partition with when no plan is given: ``recompute``, ``"except_last"`` by
    default; a list of one mode per stage is refused in one line, since only a plan made for
    those modes predicts them (partition takes one mode)."""
    if recompute is None or isinstance(recompute, str):
        return recompute or "except_last"
    listed = _modes(recompute, stages, "recompute")
    raise BuildError(f"recompute={listed!r} gives one mode per stage, which only a plan made "
                     "for them predicts; pass plan=partition(profile, ...) with those modes, "
                     "or one mode for every stage")


def runtime_recompute(plan: Plan, recompute: str | Sequence[str] | None) -> str | list[str]:
    """The recomputation a pipeline built from ``plan`` runs: the plan's mode, or its list of
    one mode per stage ([Note: per-stage recomputation] in executor/spec.py), unless
    ``recompute`` is given. A given ``recompute`` that differs from the plan's still wins, with
    a one-line warning: the plan's times and memory were predicted for its own modes."""
    k = len(plan.stages)
    planned = _modes(plan.recompute, k, "the plan's recompute")
    if recompute is None:
        return plan.recompute if isinstance(plan.recompute, str) else planned
    asked = _modes(recompute, k, "recompute")
    if asked != planned:
        warnings.warn(f"autopipe: recompute={_show(asked)} overrides the plan's {_show(planned)}, "
                      "for which its times and memory were predicted; drop recompute= to run the "
                      "plan's, or partition with this recompute", UserWarning, stacklevel=3)
    return recompute if isinstance(recompute, str) else asked


@dataclass(frozen=True)
class ExampleBatch:
    """The example inputs as a pipeline takes them: the positional inputs, then the keyword inputs
    that have a batch dimension ([Note: keyword inputs are positional inside] in
    executor/keywords.py), and their first micro-batch, which the graph, the profile and the plan
    describe ([Note: graphs are keyed to the micro-batch] in local.py)."""

    inputs: tuple[Any, ...]  # positional, then batched keyword inputs: all split
    positional: int  # how many of ``inputs`` are positional
    keywords: tuple[str, ...]  # the batched keyword inputs' names, in order
    micro: tuple[Any, ...]  # the first micro-batch of every input
    micro_kwargs: dict[str, Any]  # its keyword inputs, then the constant keywords


def example_batch(model: nn.Module, example_inputs: tuple[Any, ...] | torch.Tensor,
                  example_kwargs: Mapping[str, Any] | None, chunks: int, packed: bool = True) -> ExampleBatch:
    """``example_inputs`` and ``example_kwargs`` split as both pipelines split them: one packed
    row along its sequences ([Note: packed rows split at sequence starts] in executor/packed.py),
    as padded rows where ``packed`` is false (the rank runtime's [Note: packed rows on ranks])."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    batched, constants = split_keywords(model, example_kwargs, None)
    positional = len(inputs)
    inputs = (*inputs, *batched.values())
    micro = _first_piece(inputs, batched, chunks, packed) if POSITIONS in batched else None
    if micro is None:
        micro = microbatch_inputs(inputs, chunks)
    micro_kwargs = {**dict(zip(batched, micro[positional:], strict=True)), **constants}
    return ExampleBatch(inputs, positional, tuple(batched), micro, micro_kwargs)


def _first_piece(inputs: tuple[Any, ...], batched: Mapping[str, Any], chunks: int,
                 packed: bool) -> tuple[Any, ...] | None:
    """The first micro-batch of one packed row ([Note: packed rows split at sequence starts] in
    executor/packed.py), or with ``packed`` false its first padded row ([Note: packed rows on
    ranks]); None for a batch split by rows."""
    positions = batched[POSITIONS]
    if chunks == 1 or not isinstance(positions, torch.Tensor) or positions.dim() != 2 \
            or positions.shape[0] != 1:
        return None
    try:
        if packed:
            first = split_packed(inputs, packed_sizes(positions, chunks))[0]
        else:
            rows, _ = as_rows(inputs, list(batched), chunks)
            first = tuple(x[:1] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == chunks else x
                          for x in rows)
    except MicroBatchError as err:
        raise BuildError(str(err)) from None
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in first)


def traced(model: nn.Module, batch: ExampleBatch, trace_kwargs: Mapping[str, Any]) -> LayerGraph:
    """``model`` traced on the batch's first micro-batch."""
    return trace(model, batch.micro[:batch.positional], example_kwargs=batch.micro_kwargs,
                 **trace_kwargs)


def check_runnable(plan: Plan | None) -> None:
    """One line for a plan the one-process runtime cannot run: tensor parallelism runs on ranks."""
    if plan is not None and plan.tensor_parallel > 1:
        raise BuildError(f"the plan splits each stage over tensor_parallel={plan.tensor_parallel} ranks, "
                         "which runs on ranks only: use autopipe.distributed_pipeline(..., plan=plan) "
                         "(`autopipe run --plan`), or partition with tensor_parallel=1 for pipeline()")


def recompute_asked(recompute: str | Sequence[str] | None, plan: Plan | None,
                    stages: int) -> tuple[str | Sequence[str] | None, str]:
    """What ``recompute=`` asks of a pipeline: with a plan, to override the plan's modes (None:
    keep them; :func:`runtime_recompute`); without one, the mode to partition with
    (:func:`partition_recompute`, refused before anything is traced or profiled)."""
    if plan is not None:
        return recompute, ""
    return None, partition_recompute(recompute, stages)


def microbatch_inputs(example_inputs: tuple[Any, ...], chunks: int) -> tuple[Any, ...]:
    """The first micro-batch of ``example_inputs``: ceil(B / chunks) rows of every tensor."""
    return micro_batch(example_inputs, chunks, error=BuildError)[0]


def free_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device; None where the device does not report it (CPU)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def check_device_memory(
    plan: Plan,
    devices: Sequence[str | torch.device],
    free: Callable[[torch.device], int | None] = free_memory,
) -> None:
    """Refuse a plan whose predicted stage memory does not fit on its devices.

    Stages sharing a device add up. Devices that do not report free memory are not checked.
    """
    need: dict[torch.device, int] = {}
    stages: dict[torch.device, list[int]] = {}
    for s, device in enumerate(devices):
        dev = torch.device(device)
        need[dev] = need.get(dev, 0) + int(plan.stage_memory[s])
        stages.setdefault(dev, []).append(s)
    for dev, nbytes in need.items():
        available = free(dev)
        if available is not None and nbytes > available:
            raise BuildError(
                f"stage(s) {stages[dev]} need {format_bytes(nbytes)} (predicted peak) but {dev} "
                f"has {format_bytes(available)} free; use more stages, recompute='always', or "
                f"partition with memory_limit={format_bytes(available)!r}"
            )


def pipeline_precision(precision: object) -> str:
    """``precision`` if it is one of executor.spec.PRECISIONS, else a one-line BuildError."""
    try:
        return check_precision(precision)
    except ValueError as err:
        raise BuildError(str(err)) from None


def warn_precision_mismatch(planned: str, precision: str, what: str) -> None:
    """One warning line when a pipeline computing in ``precision`` was planned or profiled
    (``what``) under another precision ([Note: mixed precision memory] in autopipe/core/cost.py)."""
    line = precision_mismatch(planned, precision, what)
    if line is not None:
        warnings.warn(f"autopipe: {line}", UserWarning, stacklevel=3)


def check_profile_allocator(profile: Profile, in_use: str) -> None:
    """One warning line when ``profile`` was measured under another host allocator setting than
    the pipeline runs under ([Note: freed memory stays in the process])."""
    measured = profile.meta.get("host_allocator")
    if profile.meta.get("device_type") == "cpu" and measured not in (None, in_use):
        warnings.warn(f"autopipe: the profile was measured with host_allocator={measured!r} but this "
                      f"pipeline runs with {in_use!r}, so its step time will differ from the plan's "
                      f"prediction; pass host_allocator={measured!r} or re-profile", UserWarning,
                      stacklevel=3)


