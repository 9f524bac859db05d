"""``autopipe run MODEL --nproc K``: train a model as a K-process pipeline via torchrun.

    autopipe run mlp --plan plans/mlp.json --nproc 2 --steps 20
    autopipe run mlp --nproc 4 --data-parallel 2     # 2 replicas x 2 stages, 16 rows each

With ``--data-parallel D`` the ``--nproc`` ranks run D replicas of a pipeline of nproc / D ranks
(autopipe.distributed_pipeline's ``data_parallel``), each on its own batch / D rows of the
``--batch-size`` rows; ``auto`` without ``--plan`` lets the planner pick D for that batch.

First, in this process, everything that can be checked without the ranks is checked (the plan
against the rank count and the traced model, the batch against the chunks, the rank count
against the layers) and, without ``--plan``, the model is profiled and partitioned here; each
rank's layers are printed. Then ``python -m torch.distributed.run --standalone
--nproc_per_node K -m autopipe.app.rank_main --config JSON`` runs the ranks (torchrun picks a
free port and, when one rank fails, stops the others). With ``--nnodes N --rdzv-endpoint
HOST:PORT`` the same command line on each of N hosts starts that host's K / N ranks of a c10d
rendezvous instead ([Note: one command line on every node] in autopipe/app/nodes.py).

The ranks run under autopipe/app/torchrun.py, which turns their failures into one line
([Note: one line from K ranks] there). With ``--max-restarts N`` torchrun restarts every rank
after one fails and the log says so ([Note: a restart in the log] in
autopipe/app/restart_watch.py); with ``--checkpoint-dir`` the restarted ranks resume from the
newest checkpoint ([Note: resuming a run] in autopipe/app/run_checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, cast

from autopipe.app.config import (
    DEFAULT_BATCH,
    DEFAULT_CHUNKS,
    Recompute,
    RunConfig,
    Schedule,
    resolve,
)
from autopipe.app.model_spec import load_model
from autopipe.app.run_checkpoints import check_before_start, nothing_left
from autopipe.app.torchrun import RankFailure, diagnose, launch_ranks, ranks_command
from autopipe.assemble.mesh import replicas_of
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from executor.checkpoint import checkpoint_info
from executor.spec import MULTI_STAGE_SCHEDULES, check_schedule, stage_rank

__all__ = ["RankFailure", "prepare", "torchrun_command", "run", "diagnose"]

# A run without --plan profiles the model here, in one process: the distributed runtime's call
# cost is measured only by `autopipe profile --comm` (two ranks), so the plan charges
# executor.GPipe's, and says so in one line instead of the planner's warning.
NO_DISTRIBUTED_CALL_COST = "autopipe: the profile measured no call cost of the distributed runtime"
PLANNED_HERE = ("planned from a profile of this process, with executor.GPipe's call costs; for the "
                "distributed runtime's: autopipe profile MODEL --comm, autopipe partition, then --plan")


def _stages_per_rank(config: RunConfig) -> int:
    return 2 if config.schedule in MULTI_STAGE_SCHEDULES else 1


def _check_ranks(config: RunConfig, plan: Plan | None, chunks: int, batch: int, replicas: int = 1) -> int:
    """The number of stages, after checking ranks, plan, chunks and batch agree (one line each)."""
    w = config.nproc // replicas  # ranks of one pipeline
    if batch % replicas:
        raise BuildError(f"--batch-size {batch} does not split into --data-parallel {replicas} "
                         f"replicas; use a multiple of {replicas}")
    batch //= replicas  # each replica's rows
    if plan is not None:
        k = plan.num_stages
        if config.schedule in MULTI_STAGE_SCHEDULES and k % w:
            raise BuildError(f"the plan has {k} stages, which {w} ranks cannot share equally (--schedule "
                             f"{config.schedule} gives each rank the same number); pass --nproc a divisor "
                             f"of {k}, or re-run `autopipe partition --stages {2 * w}`")
        if config.schedule not in MULTI_STAGE_SCHEDULES and k != w:
            per = f" / {replicas} replicas" if replicas > 1 else ""
            raise BuildError(f"the plan has {k} stages but --nproc {config.nproc}{per} starts {w} ranks of "
                             f"one stage each; pass --nproc {k * replicas}, or re-run `autopipe "
                             f"partition --stages {w}` for {w} ranks")
    else:
        k = w * _stages_per_rank(config)
    if batch % chunks:
        lower, upper = batch // chunks * chunks, (batch // chunks + 1) * chunks
        fits = f"{lower} or {upper}" if lower else str(upper)
        if replicas > 1:
            fits = f"{lower * replicas} or {upper * replicas}" if lower else str(upper * replicas)
        what = f"{batch} rows per replica" if replicas > 1 else f"--batch-size {batch}"
        raise BuildError(f"{what} is not a multiple of --chunks {chunks}: the ranks pass "
                         f"equal micro-batches; use --batch-size {fits}")
    rounds = max(1, chunks // w)
    if config.schedule in ("interleaved1f1b", "interleaved_zb") and chunks % rounds:
        raise BuildError(f"--schedule {config.schedule} needs --chunks a multiple of its rounds "
                         f"(chunks // nproc = {rounds}); use --chunks {w * rounds} or another multiple of {w}")
    try:  # what the schedule's torch class accepts (executor.spec)
        check_schedule(config.schedule or "gpipe", k, w, chunks)
    except ValueError as err:
        raise BuildError(f"--schedule {config.schedule}: {err}") from None
    return k


def prepare(config: RunConfig, work_dir: str | os.PathLike[str]) -> tuple[RunConfig, Plan, str]:
    """Check ``config`` against its plan and model before any rank starts, and resolve it.

    Returns the config every rank reads (plan path, chunks, batch and checkpoint filled in), the
    plan, and where the plan came from. Without ``config.plan`` the model is profiled (with
    ``config.threads`` threads, as a rank runs) and partitioned here, into ``work_dir/plan.json``,
    with executor.GPipe's call costs (the planner's warning about them silenced: run() prints
    PLANNED_HERE instead).
    """
    import torch

    from autopipe.assemble.setup import microbatch_inputs
    from autopipe.assemble.tensor_parallel import roles_of
    from autopipe.frontend.tracing.graph import trace

    plan = Plan.load(config.plan) if config.plan else None
    degree = plan.tensor_parallel if plan is not None else 1  # [Note: tensor parallelism on ranks]
    if config.nproc % degree:
        raise BuildError(f"--nproc {config.nproc} does not split into the plan's tensor_parallel={degree} groups; "
                         f"start PP x TP x DP ranks (a multiple of {degree})")
    full, config = config, dataclasses.replace(config, nproc=config.nproc // degree)  # TP groups as ranks
    # one schedule from here on: the flag's, else the plan's, else gpipe
    config = dataclasses.replace(config, schedule=config.schedule or cast(Schedule, plan.schedule if plan else "gpipe"))
    chunks = resolve(config.chunks, plan.chunks if plan else None, default=DEFAULT_CHUNKS)
    batch = resolve(config.batch_size, plan.batch_size if plan else None, default=DEFAULT_BATCH)
    checkpoint = config.recompute or cast(Recompute, plan.recompute if plan else "except_last")
    asked = config.replicas()
    auto = asked == "auto" and plan is None  # the planner picks D below
    replicas, dp_mode = (1, config.dp_mode or "ddp") if auto else replicas_of(plan, asked, config.dp_mode,
                                                                              config.nproc)
    k = _check_ranks(config, plan, chunks, batch, replicas)
    loaded = load_model(config.model, batch // replicas, for_training="autopipe run")
    check_before_start(config.checkpoint_dir, config.resume, loaded.model)  # [Note: resuming a run]
    micro = microbatch_inputs(loaded.inputs, chunks)
    graph = trace(loaded.model, micro)
    if len(graph.layers) < k:
        per = f" ({_stages_per_rank(config)} per rank with --schedule {config.schedule})" if k > config.nproc else ""
        raise BuildError(f"--nproc {config.nproc} needs {k} stages{per} of at least one layer each, but "
                         f"{config.model} traces to {len(graph.layers)} layers; use --nproc "
                         f"{len(graph.layers) // _stages_per_rank(config)} or fewer")
    if plan is not None:
        plan.check(graph.layers, graph.fingerprint, micro_batch_size=math.ceil(batch // replicas / chunks))
        if degree > 1:  # the model's heads and features take the degree, before any rank starts
            roles_of(graph, degree)
        where = str(config.plan)
    else:
        from autopipe.app.profile_job import _loss_of
        from autopipe.frontend.profiling.profiler import profile
        from autopipe.solvers.partitioner import partition

        before = torch.get_num_threads()
        torch.set_num_threads(config.threads)
        try:
            prof = profile(loaded.model, loaded.inputs, chunks=chunks, graph=graph, name=loaded.name,
                           progress=False, host_allocator=config.host_allocator,
                           precision=config.precision,
                           **_loss_of(loaded))  # [Note: the loss in the last stage]
        finally:
            torch.set_num_threads(before)
        with warnings.catch_warnings():  # a profile made here has no such cost: run() says so, once
            warnings.filterwarnings("ignore", message=NO_DISTRIBUTED_CALL_COST)
            if replicas == 1 and not auto:
                plan = partition(prof, devices=[f"rank{stage_rank(config.schedule or 'gpipe', s, config.nproc)}"
                                                for s in range(k)],
                                 chunks=chunks, recompute=checkpoint, runtime="distributed")
            else:  # [Note: pipeline x data parallel]: replicas of batch / D rows on the nproc ranks
                plan = partition(prof, devices=[f"rank{r}" for r in range(config.nproc)], chunks=chunks,
                                 recompute=checkpoint, batch_size=batch, stages=None if auto else k,
                                 data_parallel="auto" if auto else replicas, dp_mode=dp_mode,
                                 runtime="distributed")
        if replicas != 1 or auto:
            replicas = plan.data_parallel
            _check_ranks(config, plan, chunks, batch, replicas)
        where = str(plan.save(Path(work_dir) / "plan.json"))
    resolved = dataclasses.replace(config, nproc=full.nproc, plan=where, chunks=chunks, batch_size=batch, recompute=checkpoint,
                                   data_parallel=str(replicas), dp_mode=cast(Any, dp_mode))
    return resolved, plan, where


def layout(config: RunConfig, plan: Plan, where: str) -> str:
    """Which layers each rank runs, with the plan's predicted time per micro-batch."""
    d, t = int(config.data_parallel or 1), plan.tensor_parallel
    w = config.nproc // d // t  # pipeline ranks of a replica; global rank (r x w + s) x t + j
    micro = math.ceil((config.batch_size or 1) // d / (config.chunks or 1))
    spans = plan.spans()
    wide = max(len("first .. last"), *(len(x) for x in spans))
    each = f"{d} replicas ({config.dp_mode}) of {config.batch_size // d if config.batch_size else 1} rows, " if d > 1 else ""
    ranks = [",".join(str((r * w + stage_rank(config.schedule or plan.schedule, s, w)) * t + j) for r in range(d)
                      for j in range(t))
             for s in range(len(plan.stages))]  # [Note: the (dp, pp, tp) mesh]
    mesh = f", each stage over TP {t}{' split by tokens' * plan.sequence_parallel}" if t > 1 else ""
    rw = max(4, *(len(x) for x in ranks))
    amp = "" if config.precision == "fp32" else f", precision={config.precision}"
    lines = [f"{config.model} on {config.nproc} ranks ({config.schedule}, recompute={config.recompute}{amp}): "
             f"batch {config.batch_size} {'as ' + each if each else ''}in {config.chunks} micro-batches of "
             f"{micro} rows{mesh}; plan {where}",
             f"{'rank':>{rw}}  {'stage':>5}  {'layers':>6}  {'first .. last':<{wide}}  {'ms per micro-batch':>18}"]
    for s, names in enumerate(plan.stages):
        lines.append(f"{ranks[s]:>{rw}}  {s:>5}  {len(names):>6}  {spans[s]:<{wide}}  "
                     f"{plan.stage_times[s]:>18.3f}")
    return "\n".join(lines)


def torchrun_command(config: RunConfig, log_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The torchrun command line that runs ``config`` on ``config.nproc`` processes, on this host
    or this node's share of them ([Note: one command line on every node] in
    autopipe/app/nodes.py); with ``log_dir``, the ranks' stderr goes to files there ([Note: one
    line from K ranks])."""
    return ranks_command(config, config.nproc, "autopipe.app.rank_main", log_dir, restarts=config.max_restarts)


def run(
    config: RunConfig,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float | None = None,
    log: bool = True,
) -> int:
    """Check, plan and run ``config`` under torchrun; 0 when every rank finished.

    Raises RankFailure (one line) when a rank fails, after stopping the others; the ranks' and
    torchrun's logs stay in ``log_dir`` (default: a new ``autopipe-run-*`` temporary directory).
    Returns 124 when ``timeout`` seconds pass first.
    """
    if config.checkpoint_dir is not None and config.resume:  # nothing to plan or start when done
        done = checkpoint_info(config.checkpoint_dir)
        if done["step"] >= config.steps:
            print(nothing_left("autopipe run", done["folder"], done["step"], config.steps), flush=True)
            return 0
    work = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="autopipe-run-"))
    work.mkdir(parents=True, exist_ok=True)
    resolved, plan, where = prepare(config, work)
    if log:
        print(layout(resolved, plan, where), flush=True)
        if config.plan is None:
            print(PLANNED_HERE, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), **(extra_env or {})}
    return launch_ranks(torchrun_command(resolved, work / "torchrun"), work, config.nproc // config.nnodes,
                        nodes=config.nnodes, world=config.nproc, env=env, timeout=timeout,
                        restarts=config.max_restarts)
