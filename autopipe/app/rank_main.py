"""One rank of ``autopipe run``: train a model as a distributed pipeline.

Started by torchrun (see autopipe.app.launch), which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; what to train arrives as ``--config JSON``, a RunConfig (autopipe.app.config)
that the launcher has already checked and resolved (plan, chunks, batch, checkpoint), so the
ranks and the command line share one set of defaults. Every rank builds the same model and
inputs (seeded), joins the process group (gloo on CPU, NCCL on CUDA; a CPU rank first pins
itself to its share of the host's cores: [Note: ranks pinned to cores] in executor/ranks/rank_cores.py,
unless ``--no-pin-cores``), builds its stage with
:func:`autopipe.distributed_pipeline` and runs AdamW over its own stage's parameters (after
``pipe.clip_grad_norm_`` with ``--clip-grad``, the norm printed beside the loss; under
``--precision fp16`` through a PipelineGradScaler, executor/ranks/grad_scaler.py). The last
rank prints the loss of every step and the throughput. With ``data_parallel`` D > 1 each
replica trains its own batch / D rows of the (seeded, same on every rank) batch, and the last
rank of replica 0 prints its replica's loss and the whole batch's throughput.

Step ``s`` trains on the model's batch of that step (``LoadedModel.batch``: [Note: a batch per
step] in autopipe/examples.py; a factory without per-step batches trains on its one batch every
step). With ``--checkpoint-dir`` the ranks save after the last step and every
``--checkpoint-every`` steps; with ``--resume``, or when torchrun's elastic agent has restarted
them after a failure (``--max-restarts``; TORCHELASTIC_RESTART_COUNT > 0), they load the newest
whole checkpoint and train on from its step, rank 0 printing where and which steps run again
([Note: resuming a run] in autopipe/app/run_checkpoints.py).

Testing hook: ``AUTOPIPE_FAULT="rank=R,step=S,signal=KILL|STOP[,when=step|save][,attempt=A]"``
makes rank R kill or stop itself mid-step or mid-save in attempt A (default 0, the first run), as
a crash or a hang would (autopipe/app/faults.py); without it, nothing of that runs.

A failure ends the rank with ONE line on stderr that the launcher reads back ([Note: one line
from K ranks] in autopipe/app/torchrun.py): ``autopipe run: error on rank R [at step S]: ...``
for bad input (AutopipeError, ExecutorError), executor's ``PipelineFailure: ...`` when a peer
died or hung, also when torchrun's SIGTERM (sent once a peer is dead) comes first ([Note: SIGTERM
grace] in autopipe/app/sigterm_grace.py).

Run as a rank (``python -m``), the module imports torch and autopipe with the cyclic collector
paused and then freezes what they made (``gc.freeze()``, [Note: a rank's imports without the
collector] in autopipe/app/_startup.py): the rank's own process-wide choice; imported from
elsewhere it leaves the collector as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from autopipe.app._startup import collector_paused, freeze_imports

with collector_paused():  # [Note: a rank's imports without the collector] in autopipe/app/_startup.py
    import torch
    import torch.distributed as dist

    from autopipe.app import sigterm_grace
    from autopipe.app.config import DEFAULT_BATCH, DEFAULT_CHUNKS, RunConfig
    from autopipe.app.faults import Faults
    from autopipe.app.model_spec import load_model
    from autopipe.app.run_checkpoints import RunCheckpoints, restart_count
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan
    from autopipe.errors import AutopipeError, BuildError
    from executor.errors import ExecutorError
    from executor.ranks.distributed import DistributedPipeline, PipelineFailure
    from executor.ranks.grad_scaler import PipelineGradScaler
    from executor.ranks.rank_cores import pin_local_rank

__all__ = ["main", "train", "check_same_run", "NODE_OWN"]


@dataclass
class Progress:
    step: int = 0  # the step being run (1-based); 0 while the stage is being built


# a node's own: where it is, how its cores are used, where its copy of the plan lies
NODE_OWN: dict[str, Any] = {"node_rank": None, "local_addr": None, "threads": 1, "no_pin_cores": False, "plan": None}


def check_same_run(config: RunConfig) -> None:
    """Every rank trains what rank 0 does: the same flags (but each node's own, ``NODE_OWN``) and
    the same plan, wherever its file lies ([Note: one command line on every node] in
    autopipe/app/nodes.py); else one line on every rank, before any stage is built."""
    flags = {**dataclasses.asdict(config), **NODE_OWN}  # not a config: a node's own are blanked
    mine: tuple[dict[str, Any], dict[str, Any] | None] = (flags, Plan.load(config.plan).to_dict()
                                                           if config.plan else None)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first, plan = cast(tuple[dict[str, Any], Any], every[0])
    for rank, (theirs, their_plan) in enumerate(cast(list[tuple[dict[str, Any], Any]], every[1:]), 1):
        differ = [f"--{k.replace('_', '-')} {theirs[k]} (rank 0: {first[k]})" for k in flags if theirs[k] != first[k]]
        if their_plan != plan:
            differ.append("another plan (its --plan file differs from rank 0's)")
        if differ:
            raise BuildError(f"rank {rank} was started with {', '.join(differ)}; run the same `autopipe run` "
                             "command line on every node, with a copy of the same plan")


def train(config: RunConfig, progress: Progress | None = None) -> list[float]:
    """The loop on this rank; the per-step losses on the last rank, [] elsewhere."""
    progress = progress or Progress()
    torch.set_num_threads(config.threads)
    plan = Plan.load(config.plan) if config.plan else None
    chunks = config.chunks or (plan.chunks if plan else DEFAULT_CHUNKS)
    batch = config.batch_size or DEFAULT_BATCH
    checkpoint = config.recompute or (plan.recompute if plan else "except_last")
    schedule = config.schedule or (plan.schedule if plan else "gpipe")
    ex = load_model(config.model, batch, for_training="autopipe run")  # same seed on every rank
    assert ex.loss_fn is not None
    replicas = int(config.data_parallel or (plan.data_parallel if plan else 1))
    mine = dist.get_rank() // (dist.get_world_size() // replicas)  # [Note: replicas on a mesh]

    def local(x: object) -> object:  # this replica's rows of the batch
        return x.tensor_split(replicas)[mine] if isinstance(x, torch.Tensor) and x.dim() else x

    pipe = distributed_pipeline(ex.model, tuple(local(x) for x in ex.inputs), loss_fn=ex.loss_fn, plan=plan,
                                chunks=chunks, recompute=checkpoint, schedule=schedule,
                                timeout=config.timeout, first_step_timeout=config.first_step_timeout,
                                host_allocator=config.host_allocator, data_parallel=replicas,
                                dp_mode=config.dp_mode, precision=config.precision)

    def placed(x: object) -> object:
        x = local(x)
        return x.to(pipe.device) if isinstance(x, torch.Tensor) else x

    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=config.lr)
    # fp16: the loss scaled in the schedule, an overflow on any rank skipping every rank's step
    scaler = PipelineGradScaler(pipe, enabled=config.precision == "fp16")
    rank, restart = dist.get_rank(), restart_count()
    first, saver = _resume(config, pipe, opt, scaler, rank, restart)
    faults = Faults.from_env(rank, restart)  # the testing hook; none without AUTOPIPE_FAULT
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(first, config.steps):
        progress.step = step + 1
        if saver is not None and rank == 0:
            saver.started(step + 1)
        if step == first + 1:  # the first step warms up (allocations, connections)
            start = time.perf_counter()
        batch_inputs, batch_target = ex.batch(step)  # [Note: a batch per step]
        inputs, target = tuple(placed(x) for x in batch_inputs), placed(batch_target)
        opt.zero_grad(set_to_none=True)
        with faults.during_step(step + 1, pipe.stages):
            loss = pipe.step(*inputs, target=target, scaler=scaler if scaler.is_enabled() else None)
        norm = None
        if config.clip_grad is not None:
            scaler.unscale_(opt)  # a no-op unless fp16
            norm = float(pipe.clip_grad_norm_(config.clip_grad))
        scaler.step(opt)
        scaler.update()
        if loss is not None and pipe.dp_rank == 0 and pipe.tp_rank == 0:  # a TP group's ranks: one loss
            losses.append(float(loss))
            clipped = "" if norm is None else f"  grad norm {norm:.4f}"
            print(f"step {step + 1:>4}/{config.steps}  loss {losses[-1]:.4f}{clipped}", flush=True)
        if saver is not None and saver.due(step + 1, config.steps):
            with faults.during_save(step + 1):
                saver.save(pipe, opt, step + 1, {"model": config.model, "batch_size": batch,
                                                 "grad_scaler": scaler.state_dict()})
    elapsed = time.perf_counter() - start
    timed = max(config.steps - first - 1, 1)
    if pipe.is_last and pipe.dp_rank == 0 and pipe.tp_rank == 0 and first < config.steps:
        each = f"{pipe.dp_size} replicas ({config.dp_mode or 'ddp'}) x " if pipe.dp_size > 1 else ""
        amp = "" if config.precision == "fp32" else f", {config.precision}"
        tp = f" x TP {plan.tensor_parallel}" if plan is not None and plan.tensor_parallel > 1 else ""
        print(f"{config.model}: {each}{pipe.pp_size} ranks{tp} x {len(pipe.stages)} stage(s), {schedule}{amp}, "
              f"chunks={chunks}, batch {batch}: {timed * batch / elapsed:.1f} samples/s", flush=True)
    return losses


def _resume(config: RunConfig, pipe: DistributedPipeline, opt: torch.optim.Optimizer,
            scaler: PipelineGradScaler, rank: int, restart: int) -> tuple[int, RunCheckpoints | None]:
    """The step to start from (the checkpoint's when resuming) and where to save, if anywhere;
    rank 0 prints where the run resumed ([Note: resuming a run])."""
    saver = RunCheckpoints.of(config.checkpoint_dir, config.checkpoint_every, config.keep,
                              config.resume or restart > 0, "autopipe run")
    first, line = 0, ""
    if saver is not None:
        first, extra, line = saver.load(pipe, opt, config.steps, restart)
        if extra.get("grad_scaler") and scaler.is_enabled():
            scaler.load_state_dict(extra["grad_scaler"])
    elif restart:
        line = f"autopipe run: restart {restart}: no --checkpoint-dir, starting again from step 1"
    if line and rank == 0:
        print(line, flush=True)
    return first, saver


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopipe.app.rank_main",
                                     description="one rank of `autopipe run` (start it with torchrun)")
    parser.add_argument("--config", required=True, help="a RunConfig as JSON (autopipe run writes it)")
    config = RunConfig.from_json(parser.parse_args(argv).config)
    if "RANK" not in os.environ:
        print("autopipe.app.rank_main: error: start me with torchrun (or `autopipe run`)",
              file=sys.stderr)
        return 2
    grace = sigterm_grace.install()  # a SIGTERM still lets this rank write its report
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif not config.no_pin_cores:  # before the process group starts its threads
        cores = pin_local_rank()
        if cores is not None and config.threads > len(cores):
            print(f"autopipe run: warning: --threads {config.threads} on {len(cores)} core(s) per rank; pass "
                  f"--threads {len(cores)}, or --no-pin-cores to share all cores", file=sys.stderr, flush=True)
    # the default group waits while rank 0 plans and every rank builds: the first step's limit
    dist.init_process_group(backend, timeout=datetime.timedelta(
        seconds=max(config.timeout, config.first_step_timeout)))
    try:
        status = _train_reporting(config)
    finally:
        dist.destroy_process_group()
    grace.finish(status)  # not reached on an unexpected error: its traceback, status 1 (a SIGTERM: 143)
    return status


def _train_reporting(config: RunConfig) -> int:
    """:func:`train`, its failures as the one line the launcher reads back: the exit status."""
    progress = Progress()
    try:
        if config.nnodes > 1:
            check_same_run(config)
        train(config, progress)
    except (AutopipeError, ExecutorError) as err:
        at = f" at step {progress.step}" if progress.step else ""
        print(f"autopipe run: error on rank {dist.get_rank()}{at}: {err}", file=sys.stderr, flush=True)
        return 2
    except PipelineFailure as err:
        print(f"PipelineFailure: {err}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    freeze_imports()
    raise SystemExit(main())
