"""pipeline(model, example_inputs, devices=...) -> a ready-to-train executor.GPipe.

    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"], chunks=8)
    opt = torch.optim.AdamW(pipe.parameters())
    loss = loss_fn(pipe(x), y); loss.backward(); opt.step()

[Note: graphs are keyed to the micro-batch] A pipeline runs micro-batches, so the profile, the
plan's fingerprint and the traced graph all describe ONE micro-batch: the first ceil(B / chunks)
rows of the example inputs (executor.microbatch splits a batch the same way). A plan made with
``autopipe profile --batch-size 32 --chunks 4`` therefore matches ``pipeline(model, (x32,),
chunks=4)``, and is refused, with a message saying why, for ``chunks=8``.

[Note: a plan is a prediction for a placement] A plan's times assume its own devices: made
with ``stages=2`` it predicts two separate devices, and ``devices=["cpu", "cpu"]`` then runs
both stages on one CPU, where they take turns (one worker per device: executor.local.worker). So a
pipeline keeps, as ``pipe.plan``, the plan re-evaluated for the devices it really runs on: the
same stages and per-stage costs, its devices renamed to the runtime's names
(``device_names``) and its iteration time, bubble and peaks simulated again, where stages
sharing a name take turns ([Note: shared devices] in autopipe/core/simulator.py).
:func:`pipeline` says so in one warning when the names differ. Only the names move: a plan's
device speeds and memory stay the plan's, since nothing at build time measures the real ones.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopipe.assemble.pretrained import model_configs, save_pretrained
from autopipe.assemble.setup import (
    DEFAULT_PIPELINE_CHUNKS,
    check_device_memory,
    check_profile_allocator,
    check_runnable,
    device_names,
    example_batch,
    graph_model_loss,
    graph_signature,
    pipeline_precision,
    placement_warning,
    plan_for_devices,
    recompute_asked,
    runtime_recompute,
    traced,
    warn_precision_mismatch,
)
from autopipe.core.plan import Plan
from autopipe.core.planned_precision import precision_of
from autopipe.core.profile_table import Profile
from autopipe.errors import BuildError, ProfileError
from autopipe.frontend.building.materialize import materialize_stages
from autopipe.frontend.building.stages import build
from autopipe.frontend.building.weights import Weights
from autopipe.frontend.tracing.graph import LayerGraph
from executor import GPipe
from executor.decision import Decision
from executor.host_allocator import check_host_allocator, host_allocator_in_use, use_host_allocator
from executor.spec import renamed_recompute

__all__ = ["Pipeline", "pipeline"]


class Pipeline(GPipe):
    """An executor.GPipe that also remembers its plan, re-evaluated for the devices it runs on
    ([Note: a plan is a prediction for a placement]), and the graph it was built from."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[str | torch.device],
                 decision: Decision, deferred_batch_norm: bool, *, plan: Plan, graph: LayerGraph,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, model: nn.Module | None = None) -> None:
        super().__init__(stages, devices, decision=decision, deferred_batch_norm=deferred_batch_norm,
                         loss_fn=loss_fn, signature=graph_signature(graph),
                         model_loss=graph_model_loss(graph, loss_fn))
        self.plan = plan_for_devices(plan, self.devices)
        self.graph = graph
        # [Note: the model's call]
        self.__class__ = _called_as(self)
        # what HuggingFace's Trainer and save_pretrained read of the model ([Note: the model's
        # call]): its configs, its loss_type (by which Trainer counts a causal LM's items after
        # the label shift) and how it takes num_items_in_batch; the model itself is not kept
        self._configs = model_configs(model)
        self.config, self.loss_type = self._configs[0], getattr(model, "loss_type", None)
        self._loss_kwargs = _loss_kwargs(model) if model is not None else (True, True)

    @property
    def hf_device_map(self) -> dict[str, str]:
        """Each stage's device, as HuggingFace names a model placed over devices: Trainer then
        leaves a pipeline over several GPUs where it is, and accelerate does not move it
        ([Note: a pipeline stays where it was placed] in executor/local/placement.py)."""
        return {f"stages.{i}": str(device) for i, device in enumerate(self.devices)}

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether HuggingFace's Trainer passes ``num_items_in_batch``: as it decides for the model
        itself, where the pipeline computes the model's own loss ([Note: the model's call])."""
        return self.model_loss is not None and self._loss_kwargs[0]

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Save the model as ``model.save_pretrained(folder)`` would, one shard per stage:
        ``from_pretrained(folder)`` and ``autopipe.pipeline(..., weights=folder)`` read it
        ([Note: saved as the model] in autopipe/assemble/pretrained.py). Returns the index's
        path; refuses to overwrite a saved model unless ``overwrite``."""
        parts = [{prefix + key: value for key, value in stage.state_dict().items()}
                 for prefix, stage in zip(self.key_prefixes, self.stages, strict=True)]
        return save_pretrained(parts, self._configs, folder, overwrite=overwrite)


# [Note: the model's call] A pipeline is called as the traced model was: ``pipe(**batch)`` with
# the keywords it was traced with (executor.keywords.InputSignature). Its ``forward`` says so to
# tools that read a model's signature, as HuggingFace's Trainer does to keep a dataset's columns
# (remove_unused_columns): ``inspect.signature(pipe.forward)`` names the traced inputs, then
# ``target`` for a loss_fn of the caller's, or ``num_items_in_batch`` for the model's own loss,
# which is then over that many items (the batches a step accumulates), as HuggingFace's models
# take it. With the model's ``config`` and ``loss_type`` beside it, Trainer(model=pipe) counts
# those items as it does for the model itself and trains the pipeline as it trains the model.
# Tools read the signature from the class (Trainer's label names: ``find_labels(type(model))``,
# by which its evaluation loop knows that a batch has labels and reports the loss), and each
# pipeline traces its own inputs, so a pipeline's class is a subclass of Pipeline per signature
# (``_called_as``), of the same name, whose ``forward`` is GPipe's under that signature.
_CALLED_AS: dict[tuple[type, str], type] = {}


def _called_as(pipe: Pipeline) -> type:
    """Pipeline's subclass whose ``forward`` names ``pipe``'s inputs ([Note: the model's call])."""
    signature = _signature(pipe)
    key = (type(pipe), str(signature))
    if key not in _CALLED_AS:
        def forward(self: Pipeline, *inputs: Any, **keywords: Any) -> Any:
            if not self._loss_kwargs[1]:  # the model's loss is its own mean, whatever it is passed
                keywords.pop("num_items_in_batch", None)
            return GPipe.forward(self, *inputs, **keywords)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward.__doc__ = GPipe.forward.__doc__
        base = type(pipe)
        _CALLED_AS[key] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                         "__qualname__": base.__qualname__})
    return _CALLED_AS[key]


def _signature(pipe: Pipeline) -> inspect.Signature:
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    signature = pipe.signature
    if signature is not None:
        params += [inspect.Parameter(f"input_{i}", inspect.Parameter.POSITIONAL_ONLY)
                   for i in range(signature.positional)]
        params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in signature.keywords]
    else:
        params.append(inspect.Parameter("inputs", inspect.Parameter.VAR_POSITIONAL))
    if pipe.loss_fn is not None:
        params.append(inspect.Parameter("target", inspect.Parameter.KEYWORD_ONLY))
    elif pipe.model_loss is not None:
        params.append(inspect.Parameter("num_items_in_batch", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


def _loss_kwargs(model: nn.Module) -> tuple[bool, bool]:
    """Whether Trainer passes the model ``num_items_in_batch`` (its ``accepts_loss_kwargs``, else
    a ``**kwargs`` in its forward, Trainer's own rule), and whether its loss then divides by it:
    HuggingFace's models that compute their loss through ``self.loss_function`` do, others
    (BERT's masked LM: a mean CrossEntropyLoss) take it and keep their mean ([Note: the model's
    call])."""
    forward = type(model).forward
    try:
        passed = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(forward).parameters.values())
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return True, True
    passed = bool(getattr(model, "accepts_loss_kwargs", passed))
    return passed, "self.loss_function(" in source or "loss_function" not in dir(model)


def pipeline(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor = (),
    *,
    devices: Sequence[str | torch.device],
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    chunks: int | None = None,
    recompute: str | Sequence[str] | None = None,
    plan: Plan | None = None,
    profile: Profile | None = None,
    method: str = "auto",
    memory_limit: int | str | None = None,
    optimizer: str = "adam",
    deferred_batch_norm: bool = False,
    graph: LayerGraph | None = None,
    weights: Weights | None = None,
    init: Callable[[nn.Module], None] | None = None,
    host_allocator: str = "system",
    precision: str = "fp32",
    checkpoint: str | Sequence[str] | None = None,  # recompute's old name, until the next release
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
        example_kwargs: one mini-batch of keyword inputs (``input_ids=``, ``attention_mask=``,
            ``labels=``): batched tensors are split into micro-batches and the pipeline is
            called with the same keywords, ``pipe(**batch)``; other values are constants
            (see :func:`autopipe.trace`). A model that returns its own loss (``labels=``) gets
            it back weighted per micro-batch by counted tokens, equal to the whole batch's
            ([Note: a loss the model computes] in executor/model_loss.py).
        loss_fn: ``loss_fn(output, target)``, computed by the last stage on each micro-batch:
            ``pipe(x, target=y)`` then returns the micro-batches' losses weighted by rows (the
            whole batch's for a mean loss), as ``DistributedPipeline.step`` does.
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"] * 4``.
        chunks: micro-batches per mini-batch; default: the plan's, else ``DEFAULT_PIPELINE_CHUNKS`` (8).
        recompute: recomputation: ``"always"``, ``"except_last"`` or ``"never"``, or a list
            with one of them per stage; default: the plan's (its mode or per-stage list), and
            ``"except_last"`` to partition with. See :func:`runtime_recompute`.
        plan: a saved Plan (``autopipe.Plan.load``) to use instead of partitioning. It is kept
            as ``pipe.plan`` re-evaluated for ``devices``, with a warning when its devices
            differ ([Note: a plan is a prediction for a placement]).
        profile: a saved Profile to partition instead of measuring one.
        method, memory_limit, optimizer: passed to :func:`autopipe.partition`.
        weights: the model's weights, read stage by stage: a ``.safetensors`` file, a
            HuggingFace ``*.safetensors.index.json`` (or its folder), a ``torch.save``d
            state_dict, or a mapping; keys are the model's ([Note: weights by key]).
        init: for a meta-device model without ``weights``: called as ``init(module)`` on each
            module whose tensors need values (default: its ``reset_parameters()``).
        host_allocator: ``"system"`` (default: the process's allocator as it is) or
            ``"retain"``: on a CPU, glibc keeps freed memory for reuse, as the command line
            does ([Note: freed memory stays in the process] in executor/host_allocator.py);
            one warning line when the profile was measured under the other setting.
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: every stage computes under
            ``torch.autocast`` to that dtype on its device, over fp32 parameters and gradients
            ([Note: mixed precision] in executor/precision.py). A caller's own ``with
            torch.autocast(...)`` is honoured either way, on worker threads and in every
            recomputation. fp16 needs a ``torch.amp.GradScaler``.
        trace_kwargs: ``leaf_modules=``, ``max_depth=``, ``kwargs=`` for :func:`autopipe.trace`.

    Raises:
        BuildError, PlanError, ProfileError, PartitionError, TraceError: one-line messages.
    """
    recompute = renamed_recompute(recompute, checkpoint, "pipeline")
    precision = pipeline_precision(precision)  # refused before tracing
    devices = list(devices)
    if not devices:
        raise BuildError("devices is empty: pass one device per stage, e.g. ['cpu', 'cpu']")
    if chunks is None:
        chunks = plan.chunks if plan is not None else DEFAULT_PIPELINE_CHUNKS
    batch = example_batch(model, example_inputs, example_kwargs, chunks)
    check_runnable(plan)  # tensor parallelism runs on ranks only
    given, mode = recompute_asked(recompute, plan, len(devices))  # refused before tracing
    on_cpu = any(torch.device(d).type == "cpu" for d in devices if not isinstance(d, int))
    check_host_allocator(host_allocator)  # on any device: a typo is refused, not ignored
    in_use = use_host_allocator(host_allocator) if on_cpu else host_allocator_in_use()
    if graph is None:
        graph = traced(model, batch, trace_kwargs)
    if plan is None:
        plan = _plan(model, batch.micro, graph, profile, devices, in_use, precision,
                     method=method, chunks=chunks, recompute=mode, memory_limit=memory_limit,
                     optimizer=optimizer)
    elif len(plan.stages) != len(devices):
        raise BuildError(
            f"the plan has {len(plan.stages)} stages but {len(devices)} devices were given; "
            f"pass {len(plan.stages)} devices or re-run `autopipe partition --stages {len(devices)}`"
        )
    else:
        warn_precision_mismatch(plan.precision, precision, "plan")
    modes = runtime_recompute(plan, given)
    check_device_memory(plan, devices)
    stages = build(model, plan, graph)
    initialised = materialize_stages(model, stages, devices, weights=weights, init=init)
    if initialised and weights is None:  # with weights: only non-persistent buffers (rotary
        # inv_freq), which no weights file holds, were initialised
        warnings.warn(f"autopipe: the model is on the meta device and no weights= were given: "
                      f"{len(initialised)} module(s) were initialised ({initialised[-1]!r}, ...) "
                      "with init= or reset_parameters(); pass weights= to load trained weights",
                      UserWarning, stacklevel=2)
    decision = plan.decision.replace(  # the call's overrides; one process runs GPipe's schedule
        chunks=chunks, recompute=modes, precision=precision, devices=tuple(device_names(devices)),
        schedule="gpipe", merge_backward="unwaited", data_parallel=1)
    pipe = Pipeline(stages, devices, decision, deferred_batch_norm, plan=plan, graph=graph, loss_fn=loss_fn,
                    model=model)
    if pipe.plan is not plan:
        warnings.warn(placement_warning(plan, pipe.plan), UserWarning, stacklevel=2)
    return pipe


def _plan(model: nn.Module, micro: tuple[Any, ...], graph: LayerGraph, profile: Profile | None,
          devices: Sequence[str | torch.device], in_use: str, precision: str,
          **partition_kwargs: Any) -> Plan:
    """pipeline()'s plan when none is given: ``profile`` (checked against the graph, the
    allocator, the precision and the device) or one measured now, partitioned for the runtime
    that runs it."""
    from autopipe.frontend.profiling.profiler import profile as measure  # not on a rank's path
    from autopipe.solvers.partitioner import partition

    if profile is None:
        profile = measure(model, micro, device=str(devices[0]), graph=graph, precision=precision)
    else:
        profile.check_fingerprint(graph.fingerprint)
        check_profile_allocator(profile, in_use)
        warn_precision_mismatch(precision_of(profile.meta), precision, "profile")
        measured_on = profile.meta.get("device_type")
        target = torch.device(devices[0]).type
        if measured_on and measured_on != target:
            raise ProfileError(
                f"the profile was measured on {measured_on} ({profile.meta.get('device')}) "
                f"but the pipeline runs on {target}: its timings would misplace the cuts; "
                f"re-run `autopipe profile ... --device {devices[0]}`"
            )
    return partition(profile, devices=device_names(devices),  # the runtime's names: shared
                     runtime="gpipe",  # devices take turns; executor.GPipe: its own call cost
                     **partition_kwargs)
