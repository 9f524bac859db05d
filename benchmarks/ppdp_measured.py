"""benchmarks/ppdp.py's measured part: 4 gloo ranks as 1 x 4, 2 x 2 and 4 x 1 (replicas x stages).

    python benchmarks/ppdp.py --measured --no-llama      # or: python benchmarks/ppdp_measured.py

One process group of 4 CPU ranks (gloo, one thread each) trains the bundled uneven MLP
(autopipe.examples.UnevenMLP) on a global batch of ``--batch`` rows, as

- 1 replica of a 4-stage pipeline, 2 replicas of a 2-stage pipeline, 4 replicas of the whole
  model (``distributed_pipeline(data_parallel=D)``, DDP; each replica on batch / D rows in
  ``--chunks`` micro-batches; rank 0 profiles and partitions each replica's stages);
- and, as the baseline, one process (1 thread) over the same global batch.

A configuration's step time is the median over ``--steps`` steps (after ``--warmup``) of its
slowest rank. The ranks share this machine's cores: with fewer cores than ranks nothing runs in
parallel and no configuration can beat one process; the numbers then measure overheads only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopipe.frontend.profiling.spawned.ports import free_port
from executor.host_allocator import use_host_allocator
from executor.ranks.rank_cores import pin_local_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from forked_ranks import start_ranks  # noqa: E402 - after the path it is found on

__all__ = ["CONFIGS", "measured_table", "main"]

WORLD = 4
CONFIGS = ((1, 4), (2, 2), (4, 1))  # replicas x stages


def _example(batch: int) -> Any:
    from autopipe.examples import get_example

    return get_example("mlp", batch_size=batch)


def _times(step: Any, steps: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _config(rank: int, d: int, batch: int, chunks: int, steps: int, warmup: int) -> list[float]:
    """This rank's step times as one of ``d`` replicas of a WORLD / d stage pipeline."""
    from autopipe.assemble.ranks import distributed_pipeline

    ex = _example(batch)  # the same seeded model and global batch on every rank
    replica = rank // (WORLD // d)
    x, y = ex.inputs[0].tensor_split(d)[replica], ex.target.tensor_split(d)[replica]
    pipe = distributed_pipeline(ex.model, (x,), loss_fn=ex.loss_fn, chunks=chunks, recompute="never",
                                data_parallel=d, dp_mode="ddp", timeout=120, host_allocator="retain")
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        pipe.step(x, target=y)
        opt.step()

    return _times(step, steps, warmup)


def _rank(rank: int, batch: int, chunks: int, steps: int, warmup: int) -> list[list[float]]:
    return [_config(rank, d, batch, chunks, steps, warmup) for d, _ in CONFIGS]


def _entry(rank: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    pin_local_rank(rank, WORLD)  # as `autopipe run` places its ranks
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=300))
    times = _rank(rank, *args)
    dist.barrier()
    torch.save(times, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _one_process(batch: int, chunks: int, steps: int, warmup: int) -> float:
    ex = _example(batch)
    xs, ys = ex.inputs[0].tensor_split(chunks), ex.target.tensor_split(chunks)
    opt = torch.optim.SGD(ex.model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.stack([ex.loss_fn(ex.model(x), y) for x, y in zip(xs, ys, strict=True)]).mean().backward()
        opt.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measured_table(batch: int = 512, chunks: int = 4, steps: int = 10, warmup: int = 3) -> str:
    """The measured rows as a markdown table (see the module's docstring)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    one = _one_process(batch, chunks, steps, warmup)
    port = free_port()  # [Note: a rendezvous port]
    with tempfile.TemporaryDirectory() as out:
        start_ranks(_entry, (port, out, (batch, chunks, steps, warmup)), WORLD)
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(WORLD)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"UnevenMLP, global batch {batch}, {chunks} micro-batches per replica, {WORLD} gloo ranks "
             f"x 1 thread on {cores} core(s), DDP, no recomputation",
             "",
             "| run | replicas x stages | step ms (median) | samples/s | vs one process |",
             "|---|---|---:|---:|---:|",
             f"| one process (1 thread) | 1 x 1 | {one:.1f} | {batch / one * 1e3:.0f} | 1.00x |"]
    for c, (d, k) in enumerate(CONFIGS):
        slowest = [max(per_rank[r][c][i] for r in range(WORLD)) for i in range(steps)]
        ms = statistics.median(slowest)
        name = "pipeline" if d == 1 else "data parallel" if k == 1 else "pipeline x data parallel"
        lines.append(f"| {name} | {d} x {k} | {ms:.1f} | {batch / ms * 1e3:.0f} | {one / ms:.2f}x |")
    return "\n".join(lines)


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--measured-batch", type=int, default=512, help="the measured part's global batch")
    p.add_argument("--measured-chunks", type=int, default=4)
    p.add_argument("--measured-steps", type=int, default=10)
    p.add_argument("--measured-warmup", type=int, default=3)
    return p


def measured(args: argparse.Namespace) -> str:
    return measured_table(args.measured_batch, args.measured_chunks, args.measured_steps, args.measured_warmup)


def main(argv: Sequence[str] | None = None) -> str:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    out = measured(parser().parse_args(argv))
    print(out)
    return out


if __name__ == "__main__":
    main()
