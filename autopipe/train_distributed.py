"""One rank of ``autopipe run``: train a bundled example as a distributed pipeline.

Started by torchrun (see autopipe.launch), which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address. Every rank builds the same example, joins the process group (gloo on CPU,
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

from autopipe.distributed import distributed_pipeline
from autopipe.errors import AutopipeError
from autopipe.examples import get_example
from autopipe.plan import Plan

__all__ = ["main", "train"]


def train(args: argparse.Namespace) -> list[float]:
    """The loop on this rank; the per-step losses on the last rank, [] elsewhere."""
    torch.set_num_threads(args.threads)
    plan = Plan.load(args.plan) if args.plan else None
    chunks = args.chunks or (plan.chunks if plan else 8)
    checkpoint = args.checkpoint or (plan.checkpoint if plan else "except_last")
    ex = get_example(args.model, batch_size=args.batch_size)  # same seed on every rank
    pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, plan=plan, chunks=chunks,
                                checkpoint=checkpoint, schedule=args.schedule, timeout=args.timeout)
    inputs = tuple(x.to(pipe.device) for x in ex.inputs)
    target = ex.target.to(pipe.device)
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=args.lr)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        if step == 1:  # the first step warms up (allocations, connections)
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*inputs, target=target)
        opt.step()
        if loss is not None:
            losses.append(float(loss))
            print(f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    timed = max(args.steps - 1, 1)
    if pipe.is_last:
        print(f"{args.model}: {pipe.world} ranks x {len(pipe.stages)} stage(s), {args.schedule}, "
              f"chunks={chunks}, batch {args.batch_size}: "
              f"{timed * args.batch_size / elapsed:.1f} samples/s", flush=True)
    return losses


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopipe.train_distributed",
                                description="one rank of `autopipe run` (start it with torchrun)")
    p.add_argument("model")
    p.add_argument("--plan", default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunks", type=int, default=None)
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        print("autopipe.train_distributed: error: start me with torchrun (or `autopipe run`)",
              file=sys.stderr)
        return 2
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(args)
    except AutopipeError as err:
        print(f"autopipe run: error on rank {dist.get_rank()}: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
