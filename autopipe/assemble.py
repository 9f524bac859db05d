"""pipeline(model, example_inputs, devices=...) -> a ready-to-train executor.GPipe.

    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"], chunks=8)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = loss_fn(pipe(x), y); loss.backward(); opt.step()

[Note: graphs are keyed to the micro-batch] A pipeline runs micro-batches, so the profile, the
plan's fingerprint and the traced graph all describe ONE micro-batch: the first ceil(B / chunks)
rows of the example inputs (executor.microbatch splits a batch the same way). A plan made with
``autopipe profile --batch-size 32 --chunks 4`` therefore matches ``pipeline(model, (x32,),
chunks=4)``, and is refused, with a message saying why, for ``chunks=8``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.units import format_bytes
from autopipe.errors import BuildError, ProfileError
from autopipe.frontend.graph import LayerGraph, trace
from autopipe.frontend.inputs import micro_batch
from autopipe.frontend.materialize import materialize_stages
from autopipe.frontend.profiler import profile as measure
from autopipe.frontend.stages import build
from autopipe.frontend.weights import Weights
from executor import GPipe

__all__ = ["Pipeline", "pipeline", "microbatch_inputs", "check_device_memory", "free_memory"]


class Pipeline(GPipe):
    """An executor.GPipe that also remembers the plan and graph it was built from."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[str | torch.device],
                 chunks: int, checkpoint: str, deferred_batch_norm: bool, *, plan: Plan,
                 graph: LayerGraph) -> None:
        super().__init__(stages, devices, chunks=chunks, checkpoint=checkpoint,
                         deferred_batch_norm=deferred_batch_norm)
        self.plan = plan
        self.graph = graph


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
                f"has {format_bytes(available)} free; use more stages, checkpoint='always', or "
                f"partition with memory_limit={format_bytes(available)!r}"
            )


def pipeline(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor,
    *,
    devices: Sequence[str | torch.device],
    chunks: int = 8,
    checkpoint: str = "except_last",
    plan: Plan | None = None,
    profile: Profile | None = None,
    method: str = "auto",
    memory_limit: int | str | None = None,
    optimizer: str = "adam",
    deferred_batch_norm: bool = False,
    graph: LayerGraph | None = None,
    weights: Weights | None = None,
    init: Callable[[nn.Module], None] | None = None,
    **trace_kwargs: Any,
) -> Pipeline:
    """Trace, profile (if needed), partition, build and place ``model`` as a GPipe pipeline.

    A model built on the meta device (``with torch.device("meta"): model = ...``) is never
    materialised whole: it is profiled layer by layer, and each stage gets real tensors on its
    own device, one stage at a time ([Note: materialise per stage]), from ``weights`` or, without
    them, from ``init`` / each module's ``reset_parameters()`` (with a warning that says so).

    Args:
        model: the model to pipeline; its own parameters are used by the stages (no copies
            where the devices allow), so references the user holds stay valid.
        example_inputs: one mini-batch of positional inputs (as passed to ``model(...)``).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"] * 4``.
        chunks: micro-batches per mini-batch.
        checkpoint: recomputation mode: ``"always"``, ``"except_last"`` or ``"never"``.
        plan: a saved Plan (``autopipe.Plan.load``) to use instead of partitioning.
        profile: a saved Profile to partition instead of measuring one.
        method, memory_limit, optimizer: passed to :func:`autopipe.partition`.
        weights: the model's weights, read stage by stage: a ``.safetensors`` file, a
            HuggingFace ``*.safetensors.index.json`` (or its folder), a ``torch.save``d
            state_dict, or a mapping; keys are the model's ([Note: weights by key]).
        init: for a meta-device model without ``weights``: called as ``init(module)`` on each
            module whose tensors need values (default: its ``reset_parameters()``).
        trace_kwargs: ``leaf_modules=``, ``max_depth=``, ``kwargs=`` for :func:`autopipe.trace`.

    Raises:
        BuildError, PlanError, ProfileError, PartitionError, TraceError: one-line messages.
    """
    from autopipe.solvers.partitioner import partition

    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    devices = list(devices)
    if not devices:
        raise BuildError("devices is empty: pass one device per stage, e.g. ['cpu', 'cpu']")
    micro = microbatch_inputs(inputs, chunks)
    if graph is None:
        graph = trace(model, micro, **trace_kwargs)
    if plan is None:
        if profile is None:
            profile = measure(model, micro, device=str(devices[0]), graph=graph)
        else:
            profile.check_fingerprint(graph.fingerprint)
            measured_on = profile.meta.get("device_type")
            target = torch.device(devices[0]).type
            if measured_on and measured_on != target:
                raise ProfileError(
                    f"the profile was measured on {measured_on} ({profile.meta.get('device')}) "
                    f"but the pipeline runs on {target}: its timings would misplace the cuts; "
                    f"re-run `autopipe profile ... --device {devices[0]}`"
                )
        plan = partition(
            profile,
            devices=[str(d) for d in devices],
            method=method,
            chunks=chunks,
            checkpoint=checkpoint,
            memory_limit=memory_limit,
            optimizer=optimizer,
        )
    elif len(plan.stages) != len(devices):
        raise BuildError(
            f"the plan has {len(plan.stages)} stages but {len(devices)} devices were given; "
            f"pass {len(plan.stages)} devices or re-run `autopipe partition --stages {len(devices)}`"
        )
    check_device_memory(plan, devices)
    stages = build(model, plan, graph)
    initialised = materialize_stages(model, stages, devices, weights=weights, init=init)
    if initialised:
        warnings.warn(f"autopipe: the model is on the meta device and no weights= were given: "
                      f"{len(initialised)} module(s) were initialised ({initialised[-1]!r}, ...) "
                      "with init= or reset_parameters(); pass weights= to load trained weights",
                      UserWarning, stacklevel=2)
    return Pipeline(stages, devices, chunks, checkpoint, deferred_batch_norm, plan=plan,
                    graph=graph)
