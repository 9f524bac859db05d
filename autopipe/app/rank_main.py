"""One rank of ``autopipe run``: train a bundled example as a distributed pipeline.

Started by torchrun (see autopipe.app.launch), which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; what to train arrives as ``--config JSON``, a RunConfig (autopipe.app.config),
so the ranks and the command line share one set of defaults. Every rank builds the same example, joins the process group (gloo on CPU,
NCCL on CUDA), builds its stage with :func:`autopipe.distributed_pipeline` and runs AdamW over
its own stage's parameters. The last rank prints the loss of every step and the throughput.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from autopipe.app.config import RunConfig
from autopipe.assemble_ranks import distributed_pipeline
from autopipe.core.plan import Plan
from autopipe.errors import AutopipeError
from autopipe.examples import get_example

__all__ = ["main", "train"]


def train(config: RunConfig) -> list[float]:
    """The loop on this rank; the per-step losses on the last rank, [] elsewhere."""
    torch.set_num_threads(config.threads)
    plan = Plan.load(config.plan) if config.plan else None
    chunks = config.chunks or (plan.chunks if plan else 8)
    checkpoint = config.checkpoint or (plan.checkpoint if plan else "except_last")
    ex = get_example(config.model, batch_size=config.batch_size)  # same seed on every rank
    pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, plan=plan, chunks=chunks,
                                checkpoint=checkpoint, schedule=config.schedule, timeout=config.timeout)
    inputs = tuple(x.to(pipe.device) for x in ex.inputs)
    target = ex.target.to(pipe.device)
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=config.lr)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        if step == 1:  # the first step warms up (allocations, connections)
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*inputs, target=target)
        opt.step()
        if loss is not None:
            losses.append(float(loss))
            print(f"step {step + 1:>4}/{config.steps}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    timed = max(config.steps - 1, 1)
    if pipe.is_last:
        print(f"{config.model}: {pipe.world} ranks x {len(pipe.stages)} stage(s), {config.schedule}, "
              f"chunks={chunks}, batch {config.batch_size}: "
              f"{timed * config.batch_size / elapsed:.1f} samples/s", flush=True)
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
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.timeout))
    try:
        train(config)
    except AutopipeError as err:
        print(f"autopipe run: error on rank {dist.get_rank()}: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
