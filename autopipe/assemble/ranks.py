"""distributed_pipeline(model, example_inputs, loss_fn=...) -> this rank's part of a pipeline.

Called on every rank after ``torch.distributed.init_process_group`` (one rank per stage,
launched by ``torchrun --nproc_per_node K``)::

    pipe = autopipe.distributed_pipeline(model, (x,), loss_fn=F.cross_entropy, chunks=8)
    opt = torch.optim.AdamW(pipe.stage_module.parameters())
    for x, y in batches:
        opt.zero_grad()
        loss = pipe.step(x, target=y)        # mean micro-batch loss on the last rank, else None
        opt.step()
    torch.save(pipe.state_dict(), f"ckpt/rank{rank}.pt")   # original model keys
    plain = make_model()   # a new one: the pipeline freed ``model``'s other ranks' tensors
    parts = ["ckpt/rank0.pt", "ckpt/rank1.pt"]
    plain.load_state_dict(autopipe.merge_state_dicts(parts, model=plain), strict=True)

[Note: one plan on every rank] Every rank traces the same model on the same micro-batch
(see [Note: graphs are keyed to the micro-batch]), so the graphs and fingerprints agree. A
measured profile does not (timings differ per process), so without a ``plan`` rank 0 profiles
and partitions alone and broadcasts the plan; every rank then checks its fingerprint in
:func:`autopipe.build.build`. Rank 0's weights are broadcast too, like DistributedDataParallel
does, so ranks that built the model with different seeds still train one model. The wires
(executor/ranks/wire.py: what crosses each cut, with its sizes as formulas of the inputs') depend on
the stages and the micro-batch alone, the same on every rank, so rank 0 infers them, its probe
and its symbolic run (as costly as tracing the model), and broadcasts them; a wire that does not
pickle (a constant of the model's at a cut) leaves every rank inferring its own.

[Note: loss of a pipeline] The schedules compute ``loss_fn`` per micro-batch; ``step``
returns the mean of those losses and leaves the gradients of that mean. A single-process
reference is ``mean(loss_fn(model(x_i), y_i) over the micro-batches x_i of x)``, which equals
``loss_fn(model(x), y)`` only for mean-reduced losses over equal micro-batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.assemble import from_rank0
from autopipe.assemble import tensor_parallel as tp_ranks
from autopipe.assemble.mesh import (
    RankPipeline,
    ReplicatedRankPipeline,
    replicas_of,
    replicated_pipeline,
)
from autopipe.assemble.pretrained import model_configs
from autopipe.assemble.rank_parts import (
    merge_state_dicts,  # re-exported: the parts this module's pipelines save
)
from autopipe.assemble.setup import (
    DEFAULT_PIPELINE_CHUNKS,
    example_batch,
    graph_model_loss,
    graph_signature,
    microbatch_inputs,
    pipeline_precision,
    recompute_asked,
    runtime_recompute,
    traced,
    warn_precision_mismatch,
)
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.frontend.building.materialize import has_meta_tensors, materialize_stages
from autopipe.frontend.building.stages import build
from autopipe.frontend.building.weights import Weights
from autopipe.frontend.tracing.graph import LayerGraph
from executor.host_allocator import check_host_allocator, use_host_allocator
from executor.ranks.distributed import DistributedError
from executor.ranks.ties import check_fsdp_layout, rank_ties
from executor.ranks.watchdog import FIRST_STEP_TIMEOUT_S
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    check_schedule,
    renamed_recompute,
    stage_rank,
)

__all__ = ["distributed_pipeline", "merge_state_dicts"]


def _device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return torch.device("cpu")


def _comm_device(here: torch.device) -> torch.device:
    """Where this rank's own collectives of build time run: its GPU under NCCL (which carries no
    CPU tensors, and whose current device need not be this rank's), else the CPU."""
    return here if dist.get_backend() == "nccl" else torch.device("cpu")


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key -> every key naming the same tensor (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(key)
    return {key: keys for keys in by_id.values() for key in keys if len(keys) > 1}


def distributed_pipeline(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | Tensor = (),
    *,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    plan: Plan | None = None,
    method: str = "auto",
    chunks: int | None = None,
    recompute: str | Sequence[str] | None = None,
    schedule: str | None = None,
    stages_per_rank: int | None = None,
    data_parallel: int | str | None = None,
    dp_mode: str | None = None,
    device: str | torch.device | None = None,
    timeout: float | None = 60.0,
    first_step_timeout: float | None = FIRST_STEP_TIMEOUT_S,
    host_allocator: str = "system",
    weights: Weights | None = None,
    init: Callable[[nn.Module], None] | None = None,
    example_target: Any = None,
    precision: str = "fp32",
    graph: LayerGraph | None = None,
    checkpoint: str | Sequence[str] | None = None,  # recompute's old name, until the next release
    **trace_kwargs: Any,
) -> RankPipeline | ReplicatedRankPipeline:
    """This rank's stage(s) of ``model`` as a torch.distributed.pipelining pipeline.

    Args:
        model: the same model on every rank; only this rank's stage keeps its tensors (the
            others' parameters and buffers are freed, so ``model`` itself is no longer usable).
        example_inputs: one mini-batch of positional inputs (tensors).
        loss_fn: ``loss_fn(model_output, target)`` for one micro-batch; None: the model
            computes its own loss (HF ``labels=`` in ``example_kwargs``), weighted per
            micro-batch by its counted tokens ([Note: a loss the model computes] in
            executor/model_loss.py): ``pipe.step(**batch)`` on every rank, no target.
        example_kwargs: keyword inputs of one mini-batch (see :func:`autopipe.pipeline`);
            ``step`` takes the same keywords.
        example_target: the target of ``example_inputs``' mini-batch: without a plan, rank 0
            times ``loss_fn`` on it, which the last stage pays ([Note: the loss in the last
            stage]); without it the plan leaves the loss out.
        plan: a Plan with ``world_size / data_parallel * stages_per_rank`` stages; default:
            rank 0 partitions.
        method: the partitioner's method when no plan is given.
        chunks: micro-batches per mini-batch; default: the plan's, else ``DEFAULT_PIPELINE_CHUNKS`` (8).
        recompute: recomputation, one mode or a list of one per stage; default: the plan's
            (see :func:`autopipe.assemble.setup.runtime_recompute`), ``"except_last"`` to partition.
        schedule: ``gpipe``, ``1f1b``, ``interleaved1f1b`` (several stages per rank), or a
            zero-bubble schedule, each backward split into input and weight gradients:
            ``interleaved_zb`` (interleaved's layout), ``zbv`` or ``dualpipev`` (two stages per
            rank in a V: rank r runs stages r and 2W-1-r); default: the plan's (the schedule its
            prediction is for), else ``gpipe``. See executor/ranks/torch_schedules.py.
        stages_per_rank: default 1, or 2 for the schedules of several stages per rank (or the
            plan's stages / ranks per replica); ``zbv`` and ``dualpipev`` need 2.
        data_parallel: D replicas of a pipeline of world / D ranks, on a (dp, pp) DeviceMesh
            ([Note: replicas on a mesh] in executor/ranks/replicated.py); default: the plan's (1
            without a plan). Each replica's ``example_inputs`` and ``step`` inputs are its own
            local batch. ``"auto"``: the plan's (made with ``partition(..., devices=N,
            batch_size=B, data_parallel="auto")``: D is chosen for one global batch B).
        dp_mode: how replicas share gradients: ``ddp`` (DistributedDataParallel) or ``fsdp``
            (FSDP2 ``fully_shard``); default: the plan's (``ddp`` without a plan).
        device: default ``cuda:LOCAL_RANK`` under NCCL, else CPU.
        timeout: seconds a step may take. A peer that dies fails the step at once, and one that
            is silent for ``timeout`` fails it, with :class:`executor.PipelineFailure` on this
            rank; a step still running ``timeout`` + 5 s after it began is ended by the
            watchdog, which prints one ``PipelineFailure:`` line and ends the process with
            ``os._exit(3)`` (``executor.WATCHDOG_EXIT_CODE``), as torch's NCCL watchdog does: a
            hung step cannot be unwound. ``None`` turns the watchdog off (torch's own process
            group timeouts remain).
        first_step_timeout: the same for the first step, which builds the schedule, runs every
            lazy initialiser and may compile or warm up (default 600 s;
            [Note: the first step's own limit] in executor/ranks/watchdog.py).
        host_allocator: ``"system"`` (default: the process's allocator as it is) or
            ``"retain"`` (on a CPU, glibc keeps freed memory for reuse, as the command line
            does): see [Note: freed memory stays in the process] in executor/host_allocator.py.
        weights: the model's weights file (or mapping), read by every rank for its own stage(s)
            only; see :func:`autopipe.pipeline`. Without it, rank 0's weights are broadcast.
        init: for a meta-device model without ``weights``: ``init(module)`` for each module
            of this rank's stages (default ``reset_parameters()``), seeded per module so that
            ranks agree on tied ones ([Note: seeded per module]).
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: autocast in every stage and
            the loss, over fp32 parameters; gradients, tied copies' sums and the replicas'
            reduction in fp32 (FSDP2: ``MixedPrecisionPolicy(param_dtype=<low>,
            reduce_dtype=torch.float32)``). See [Note: distributed mixed precision] in
            executor/precision.py. A caller's ``with torch.autocast(...): pipe.step(...)`` is
            honoured either way.
        graph: this rank's ``autopipe.trace(model, <the first micro-batch>)`` to use instead of
            tracing again, as :func:`autopipe.pipeline` takes one (e.g. the graph the caller
            partitioned with). It must be of this ``model`` (its own parameters) and of the
            micro-batch ``example_inputs`` / ``example_kwargs`` split into ``chunks`` give
            (``autopipe.assemble.setup.microbatch_inputs``); another model or shape is refused in one line.
            A LayerGraph does not pickle: trace on the rank that builds.
        trace_kwargs: ``leaf_modules=``, ``max_depth=``, ``kwargs=`` for :func:`autopipe.trace`.

    A model built on the meta device is never materialised whole: every rank gives real tensors
    only to its own stage(s) ([Note: materialise per stage]).

    Raises:
        BuildError, PlanError (and the planner's errors): one-line messages, on every rank.
    """
    recompute = renamed_recompute(recompute, checkpoint, "distributed_pipeline")
    if not dist.is_initialized():
        raise BuildError("torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group(...) on every rank first")
    precision = pipeline_precision(precision)
    if schedule is None:
        schedule = plan.schedule if plan is not None else "gpipe"
    if schedule not in SCHEDULES:
        raise BuildError(f"schedule={schedule!r} is unknown; use one of {list(SCHEDULES)}")
    degree = tp_ranks.degree_of(plan)  # [Note: tensor parallelism on ranks]
    tp_ranks.check_world(degree, dist.get_world_size())
    layout = _layout(plan, schedule, data_parallel, dp_mode, stages_per_rank, degree)
    k, world = layout.stages, layout.ranks
    tp_ranks.check_replicas(degree, layout.replicas, layout.dp_mode)
    if chunks is None:
        chunks = plan.chunks if plan is not None else DEFAULT_PIPELINE_CHUNKS
    batch = example_batch(model, example_inputs, example_kwargs, chunks, packed=False)
    given, mode = recompute_asked(recompute, plan, k)
    try:  # what the schedule accepts, before any rank profiles
        check_schedule(schedule, k, world, chunks)
    except ValueError as err:
        raise BuildError(str(err)) from None
    here = _device(device)
    check_host_allocator(host_allocator)
    if here.type == "cpu":  # before rank 0 profiles: [Note: freed memory stays in the process]
        use_host_allocator(host_allocator)
    if graph is None:
        graph = traced(model, batch, trace_kwargs)
    else:
        _check_graph(graph, model, batch.micro, batch.keywords)
    model_loss = graph_model_loss(graph, loss_fn)
    if loss_fn is None and model_loss is None:
        raise BuildError("no loss_fn= and the model returns no loss autopipe can weight (a mean "
                         "cross_entropy / nll_loss of its labels): pass loss_fn=, or labels= in "
                         "example_kwargs")
    on_meta = has_meta_tensors(model)
    if weights is None and not on_meta:
        from_rank0.weights_of_rank0(model, _comm_device(here))  # every rank reads the same weights file otherwise
    if plan is None:
        plan = from_rank0.plan_of_rank0(model, batch.micro, graph, k, method=method, chunks=chunks, recompute=mode,
                            loss_fn=loss_fn, target=_first_micro_batch(example_target, chunks),
                            precision=precision, schedule=schedule, ranks=world, device=_comm_device(here))
    else:
        warn_precision_mismatch(plan.precision, precision, "plan")
    modes = runtime_recompute(plan, given)
    roles = tp_ranks.roles_of(graph, degree, plan.sequence_parallel) if degree > 1 else None
    stages = build(model, plan, graph)
    if roles is not None:
        tp_ranks.check_cuts(stages, roles)
    if layout.replicas > 1 and layout.dp_mode == "fsdp":  # on every rank, before any builds its replica
        try:
            check_fsdp_layout(stages, schedule, world)
        except DistributedError as err:
            raise BuildError(str(err)) from None
    probe = tuple(x.to("meta") if isinstance(x, Tensor) else x for x in batch.micro) if on_meta else batch.micro
    # shapes only: a meta model is probed on meta; dtypes under the precision's autocast
    wires = from_rank0.wires_of_rank0(stages, probe, precision, _comm_device(here))
    # [Note: replicas on a mesh]: rank = dp x K + pp; [Note: stage to rank]
    mine = [i for i in range(k) if stage_rank(schedule, i, world) == dist.get_rank() // degree % world]
    materialize_stages(model, stages, [here] * k, weights=weights, init=init, mine=mine)
    ties = rank_ties(stages, mine, schedule, world)
    aliases = _aliases(model)
    configs = model_configs(model)
    mesh = None
    if roles is not None:  # this rank's stages split over its TP group, the ties' copies with them
        mesh = tp_ranks.mesh_of(layout.replicas, world, degree, here, timeout, first_step_timeout)
        ties = tp_ranks.split_ties(ties, tp_ranks.split_stages(stages, mine, roles, mesh))
        wires = tp_ranks.split_wires(wires, stages, roles, degree)  # [Note: sequence parallelism on ranks]
    _free_others(model, [stages[i] for i in mine])
    decision = plan.decision.replace(  # with this call's overrides ([Note: a plan's decision])
        chunks=chunks, recompute=modes, schedule=schedule, precision=precision,
        data_parallel=layout.replicas, dp_mode=layout.dp_mode,  # the plan's merge rule is for
        merge_backward=plan.merge_backward if plan.schedule == schedule else "unwaited")  # its own
    pipe = replicated_pipeline(  # schedule ([Note: adjacent I and W])
        [stages[i] for i in mine], mine, decision, loss_fn=loss_fn if loss_fn is not None else model_loss,
        signature=graph_signature(graph), wires=wires, ties=ties, key_aliases=aliases, device=here,
        timeout=timeout, first_step_timeout=first_step_timeout, mesh=mesh)
    pipe._configs = configs
    pipe.plan = plan  # the plan it runs (this call's overrides are in pipe.decision)
    return pipe


@dataclass(frozen=True)
class _Layout:
    """Where the stages run: ``stages`` in all over ``ranks`` ranks of each of ``replicas``."""

    stages: int
    ranks: int
    replicas: int
    dp_mode: str


def _layout(plan: Plan | None, schedule: str, data_parallel: int | str | None, dp_mode: str | None,
            stages_per_rank: int | None, degree: int = 1) -> _Layout:
    """The pipeline's layout over the world's ranks (TP groups of ``degree`` as one rank each),
    or a one-line BuildError naming the fix."""
    replicas, dp = replicas_of(plan, data_parallel, dp_mode, dist.get_world_size() // degree)
    world = dist.get_world_size() // degree // replicas  # ranks of one pipeline (TP groups)
    per_rank = stages_per_rank or (len(plan.stages) // world if plan is not None
                                   and (degree == 1 or schedule in MULTI_STAGE_SCHEDULES)
                                   else 2 if schedule in MULTI_STAGE_SCHEDULES else 1)
    k = max(per_rank, 1) * world
    if plan is not None and len(plan.stages) != k:
        n = len(plan.stages)
        each = f"{per_rank} stage(s) each" if stages_per_rank else "the same number of stages each"
        per = f" per replica (of {replicas})" if replicas > 1 else ""
        tp = f" of tensor_parallel={degree}" if degree > 1 else ""
        raise BuildError(f"the plan has {n} stages but {world} ranks{tp}{per} need {each} ({k} in all); "
                         f"start {n * replicas * degree} ranks (torchrun --nproc_per_node {n * replicas * degree}, "
                         f"PP x TP x DP) or make a plan of {k} stages (`autopipe partition --stages {k}`)")
    return _Layout(k, world, replicas, dp)


def _first_micro_batch(target: Any, chunks: int) -> Any:
    """The example target's first micro-batch, as the inputs' (None: no target)."""
    if isinstance(target, tuple):
        return microbatch_inputs(target, chunks)
    return None if target is None else microbatch_inputs((target,), chunks)[0]


def _check_graph(graph: LayerGraph, model: nn.Module, micro: tuple[Any, ...],
                 keywords: tuple[str, ...]) -> None:
    """Refuse a ``graph=`` of another model or micro-batch, on every rank before any collective:
    its parameters must be ``model``'s, its inputs the micro-batch's (names, shapes, dtypes)."""
    own = {id(p) for p in model.parameters()}
    foreign = [n for n, p in graph.gm.named_parameters() if id(p) not in own]
    if foreign:
        raise BuildError(f"graph= was traced from another model (its parameter {foreign[0]!r} is "
                         "not this model's): pass autopipe.trace(model, ...) of this model, or no graph=")
    values = [n.meta.get("val") for n in graph.gm.graph.nodes if n.op == "placeholder"][:graph.num_args]

    def shapes(xs: Iterable[Any]) -> list[Any]:
        return [(tuple(x.shape), x.dtype) if isinstance(x, Tensor) else type(x).__name__ for x in xs]

    if graph.keywords != keywords or shapes(values) != shapes(micro):
        got = ", ".join(str(s) for s in shapes(micro))
        raise BuildError(f"graph= was traced on inputs {', '.join(str(s) for s in shapes(values))}"
                         f"{f' (keywords {list(graph.keywords)})' if graph.keywords else ''}, but the "
                         f"micro-batch here is {got}{f' (keywords {list(keywords)})' if keywords else ''}: "
                         "trace the model on autopipe.assemble.setup.microbatch_inputs(example_inputs, chunks), or pass no graph=")


def _free_others(model: nn.Module, keep: list[nn.Module]) -> None:
    kept = {id(t) for s in keep for t in s.state_dict(keep_vars=True).values()}
    for t in model.state_dict(keep_vars=True).values():
        if isinstance(t, Tensor) and id(t) not in kept:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
