"""One rank of ``autopipe run``: train a model as a distributed pipeline.

Started by torchrun (see autopipe.app.launch), which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; what to train arrives as ``--config JSON``, a RunConfig (autopipe.app.config)
that the launcher has already checked and resolved (plan, chunks, batch, checkpoint), so the
ranks and the command line share one set of defaults. Every rank builds the same model and
inputs (seeded), joins the process group (gloo on CPU, NCCL on CUDA; a CPU rank first pins
itself to its share of the host's cores: [Note: ranks pinned to cores] in executor/rank_cores.py,
unless ``--no-pin-cores``), builds its stage with
:func:`autopipe.distributed_pipeline` and runs AdamW over its own stage's parameters (after
``pipe.clip_grad_norm_`` with ``--clip-grad``, the norm printed beside the loss; under
``--precision fp16`` through a PipelineGradScaler, executor/grad_scaler.py). The last
rank prints the loss of every step and the throughput. With ``data_parallel`` D > 1 each
replica trains its own batch / D rows of the (seeded, same on every rank) batch, and the last
rank of replica 0 prints its replica's loss and the whole batch's throughput.

A failure ends the rank with ONE line on stderr that the launcher reads back ([Note: one line
from K ranks] in autopipe/app/launch.py): ``autopipe run: error on rank R [at step S]: ...``
for bad input (AutopipeError, ExecutorError), executor's ``PipelineFailure: ...`` when a peer
died or hung.
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

import torch
import torch.distributed as dist

from autopipe.app.config import DEFAULT_BATCH, DEFAULT_CHUNKS, RunConfig
from autopipe.app.model_spec import load_model
from autopipe.assemble_ranks import distributed_pipeline
from autopipe.core.plan import Plan
from autopipe.errors import AutopipeError, BuildError
from executor.distributed import PipelineFailure
from executor.errors import ExecutorError
from executor.grad_scaler import PipelineGradScaler
from executor.rank_cores import pin_local_rank

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
    flags = dataclasses.asdict(dataclasses.replace(config, **NODE_OWN))
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
    checkpoint = config.checkpoint or (plan.checkpoint if plan else "except_last")
    schedule = config.schedule or (plan.schedule if plan else "gpipe")
    ex = load_model(config.model, batch, for_training="autopipe run")  # same seed on every rank
    assert ex.loss_fn is not None
    replicas = int(config.data_parallel or (plan.data_parallel if plan else 1))
    mine = dist.get_rank() // (dist.get_world_size() // replicas)  # [Note: replicas on a mesh]

    def local(x: object) -> object:  # this replica's rows of the batch
        return x.tensor_split(replicas)[mine] if isinstance(x, torch.Tensor) and x.dim() else x

    pipe = distributed_pipeline(ex.model, tuple(local(x) for x in ex.inputs), loss_fn=ex.loss_fn, plan=plan,
                                chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                                timeout=config.timeout, first_step_timeout=config.first_step_timeout,
                                host_allocator=config.host_allocator, data_parallel=replicas,
                                dp_mode=config.dp_mode, precision=config.precision)
    inputs = tuple(x.to(pipe.device) if isinstance(x, torch.Tensor) else x for x in map(local, ex.inputs))
    target = local(ex.target)
    target = target.to(pipe.device) if isinstance(target, torch.Tensor) else target
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=config.lr)
    # fp16: the loss scaled in the schedule, an overflow on any rank skipping every rank's step
    scaler = PipelineGradScaler(pipe, enabled=config.precision == "fp16")
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        progress.step = step + 1
        if step == 1:  # the first step warms up (allocations, connections)
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*inputs, target=target, scaler=scaler if scaler.is_enabled() else None)
        norm = None
        if config.clip_grad is not None:
            scaler.unscale_(opt)  # a no-op unless fp16
            norm = float(pipe.clip_grad_norm_(config.clip_grad))
        scaler.step(opt)
        scaler.update()
        if loss is not None and pipe.dp_rank == 0:
            losses.append(float(loss))
            clipped = "" if norm is None else f"  grad norm {norm:.4f}"
            print(f"step {step + 1:>4}/{config.steps}  loss {losses[-1]:.4f}{clipped}", flush=True)
    elapsed = time.perf_counter() - start
    timed = max(config.steps - 1, 1)
    if pipe.is_last and pipe.dp_rank == 0:
        each = f"{pipe.dp_size} replicas ({config.dp_mode or 'ddp'}) x " if pipe.dp_size > 1 else ""
        amp = "" if config.precision == "fp32" else f", {config.precision}"
        print(f"{config.model}: {each}{pipe.pp_size} ranks x {len(pipe.stages)} stage(s), {schedule}{amp}, "
              f"chunks={chunks}, batch {batch}: {timed * batch / elapsed:.1f} samples/s", flush=True)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopipe.app.rank_main",
                                     description="one rank of `autopipe run` (start it with torchrun)")
    parser.add_argument("--config", required=True, help="a RunConfig as JSON (autopipe run writes it)")
    config = RunConfig.from_json(parser.parse_args(argv).config)
    if "RANK" not in os.environ:
        print("autopipe.app.rank_main: error: start me with torchrun (or `autopipe run`)",
              file=sys.stderr)
        return 2
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
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
