"""Two-process pipeline vs one process, auto plan vs equal layer counts, vs plain pipelining.

    python benchmarks/distributed_speedup.py            # prints a markdown table

All runs train the bundled uneven MLP (autopipe.examples.UnevenMLP) on one mini-batch of
``--batch`` rows in ``--chunks`` micro-batches, one CPU thread per process, gloo:

- one process: the plain model over the same micro-batches (loss = their mean, as the
  pipeline computes it), so the ideal 2-stage GPipe speedup is 2M / (M + 1);
- autopipe, auto plan: ``distributed_pipeline`` with the plan ``partition`` makes from a
  profile measured here (1 thread);
- autopipe, equal layers: the same runtime with ``method="uniform"`` (equal layer counts);
- torch.distributed.pipelining by hand: the peer. ``nn.Sequential`` slices cut by hand at
  the auto plan's cut (so this row isolates the runtime's overhead from the plan), wrapped in
  ``PipelineStage`` + ``ScheduleGPipe``: what a user writes without autopipe.

Timings are medians of ``--steps`` steps after ``--warmup`` steps; ratios are what matter.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes

__all__ = ["main"]


def _example(batch: int) -> Any:
    from autopipe.examples import get_example

    return get_example("mlp", batch_size=batch)


def _median_ms(step: Callable[[], object], steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _single_process(batch: int, chunks: int, steps: int, warmup: int) -> float:
    ex = _example(batch)
    xs, ys = ex.inputs[0].tensor_split(chunks), ex.target.tensor_split(chunks)

    def step() -> None:
        ex.model.zero_grad()
        torch.stack([ex.loss_fn(ex.model(x), y) for x, y in zip(xs, ys, strict=True)]).mean().backward()

    return _median_ms(step, steps, warmup)


def _autopipe_rank(rank: int, plan: dict[str, Any], batch: int, chunks: int, steps: int, warmup: int) -> float:
    from autopipe.assemble_ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    ex = _example(batch)
    pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, plan=Plan.from_dict(plan),
                                chunks=chunks, checkpoint="never")
    return _median_ms(lambda: pipe.step(*ex.inputs, target=ex.target), steps, warmup)


def _torch_rank(rank: int, cut: int, batch: int, chunks: int, steps: int, warmup: int) -> float:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    ex = _example(batch)
    net: nn.Sequential = ex.model.net
    part = net[:cut] if rank == 0 else net[cut:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, chunks, loss_fn=ex.loss_fn)

    def step() -> None:
        part.zero_grad()
        if rank == 0:
            schedule.step(ex.inputs[0])
        else:
            schedule.step(target=ex.target)

    return _median_ms(step, steps, warmup)


def _rank(rank: int, plans: list[dict[str, Any]], cut: int, run: tuple[int, ...]) -> list[float]:
    """Every 2-rank configuration in turn on one process group (one start-up for them all)."""
    times = [_autopipe_rank(rank, plan, *run) for plan in plans]
    dist.barrier()
    return [*times, _torch_rank(rank, cut, *run)]


def _entry(rank: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    times = _rank(rank, *args)
    dist.barrier()
    torch.save(times, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _two_ranks(*args: Any) -> list[float]:
    """Step times of each 2-rank run: the slower rank's median (both wait for each other)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        start_processes(_entry, args=(port, out, args), nprocs=2, start_method="spawn")
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(2)]
    return [max(a, b) for a, b in zip(*per_rank, strict=True)]


def _plans(batch: int, chunks: int) -> tuple[Any, Any]:
    from autopipe.frontend.profiler import profile
    from autopipe.solvers.partitioner import partition

    ex = _example(batch)
    prof = profile(ex.model, ex.inputs, chunks=chunks, repeats=5)
    return (partition(prof, stages=2, chunks=chunks, checkpoint="never"),
            partition(prof, stages=2, chunks=chunks, checkpoint="never", method="uniform"))


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    m, run = args.chunks, (args.batch, args.chunks, args.steps, args.warmup)
    auto, uniform = _plans(args.batch, args.chunks)
    cut = int(auto.stages[1][0].split(".")[-1])  # UnevenMLP layers are net.0 .. net.14
    one = _single_process(*run)
    auto_ms, uniform_ms, peer_ms = _two_ranks([auto.to_dict(), uniform.to_dict()], cut, run)
    rows = [
        ("one process (1 thread)", "-", one),
        ("autopipe, auto plan", _split(auto.stages), auto_ms),
        ("autopipe, equal layer counts", _split(uniform.stages), uniform_ms),
        ("torch.distributed.pipelining, hand split", f"net[:{cut}] / net[{cut}:]", peer_ms),
    ]
    ideal = 2 * m / (m + 1)
    lines = [
        f"UnevenMLP, batch {args.batch}, M={m} micro-batches, 2 gloo ranks x 1 thread, "
        f"GPipe, no recomputation; ideal 2-stage speedup 2M/(M+1) = {ideal:.2f}",
        "",
        "| run | split (layers per stage) | step ms | speedup vs one process | of ideal |",
        "|---|---|---:|---:|---:|",
    ]
    for name, split, ms in rows:
        of_ideal = "-" if ms is one else f"{one / ms / ideal:.0%}"
        lines.append(f"| {name} | {split} | {ms:.1f} | {one / ms:.2f}x | {of_ideal} |")
    lines.append("")
    lines.append(f"auto plan vs equal layer counts: {uniform_ms / auto_ms:.2f}x faster; "
                 f"vs the hand-written torch.distributed.pipelining peer: {peer_ms / auto_ms:.2f}x")
    table = "\n".join(lines)
    print(table)
    return table


def _split(stages: list[list[str]]) -> str:
    return " / ".join(f"{s[0]}..{s[-1]} ({len(s)})" for s in stages)


if __name__ == "__main__":
    main()
