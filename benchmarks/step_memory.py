"""Whole-step peak memory, predicted vs measured as live tensor bytes, in one process and per rank.

    python benchmarks/step_memory.py    # the table in docs/benchmarks.md, and what
                                        # tests/test_benchmark_step_memory.py holds within 10%

A tied language model (benchmarks/precision.py's: autopipe.examples.TinyGPT, whose head is its
token embedding) is profiled once with its loss (so the profile holds the loss's bytes: [Note:
the loss's memory] in autopipe/core/stage_memory.py), planned into 2 stages for each runtime and
schedule, and trained: one AdamW step to warm up (the optimizer's state appears), then one step
measured. The measured figure is the most live tensor storage at once over that step, forward,
loss, backward and ``optimizer.step()`` (executor.MemoryMeter: [Note: counting live bytes]),
what ``torch.cuda.max_memory_allocated`` reports on a GPU; the batch is included and the model's
weights, gradients and optimizer state are tracked from before the step. In one process the
step holds the pipeline's output through the backward, as a training loop that keeps
``outputs`` does (the prediction counts it; a loop that drops it peaks lower). The prediction is the
plan's: per rank, ``plan.peak_memory[rank]``; in one process, ``plan.device_memory`` (both
stages on the one CPU). Bytes do not drift with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing import start_processes

import autopipe
from autopipe.core.plan import Plan
from autopipe.examples import TinyGPT
from executor.memory_meter import MemoryMeter

__all__ = ["Row", "Size", "main", "measure"]


@dataclass(frozen=True)
class Size:
    vocab: int = 4096
    dim: int = 64
    layers: int = 2
    seq: int = 32
    batch: int = 16
    chunks: int = 4


@dataclass(frozen=True)
class Row:
    runtime: str  # "one process" or "2 ranks"
    schedule: str
    where: str  # "process", "rank 0", "rank 1"
    measured: int
    predicted: int

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _model(size: Size) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=size.vocab, dim=size.dim, layers=size.layers, max_len=size.seq)
    x = torch.randint(0, size.vocab, (size.batch, size.seq))
    return model, x, torch.randint(0, size.vocab, (size.batch, size.seq))


def _peak(step: Any, track: Sequence[Any]) -> int:
    step()  # the warm-up step: the optimizer's state appears
    meter = MemoryMeter(track=track)
    with meter:
        step()
    return meter.peak


def _one_process(size: Size, plan: Plan) -> int:
    model, x, y = _model(size)
    pipe = autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], plan=plan, chunks=plan.chunks,
                             recompute=plan.recompute)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def step() -> None:
        out = pipe(x)  # held through the backward, as a training loop holds its outputs
        _lm_loss(out, y).backward()
        del out
        opt.step()
        opt.zero_grad()

    return _peak(step, (pipe, opt, x, y))


def _rank_peak(size: Size, plan: Plan) -> int:
    model, x, y = _model(size)
    pipe = autopipe.distributed_pipeline(model, (x,), loss_fn=_lm_loss, plan=plan)
    del model
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=1e-3)

    def step() -> None:
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()

    return _peak(step, (pipe.stage_module, opt, x, y))


def _rank(rank: int, port: int, out: str, size: Size, plans: Sequence[Plan]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:  # one pipeline after another, each measured alone
        torch.save([_rank_peak(size, plan) for plan in plans], Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ranks(size: Size, plans: Sequence[Plan]) -> list[list[int]]:
    """Per plan, each rank's peak: one pair of spawned ranks runs them all."""
    with tempfile.TemporaryDirectory() as out:
        start_processes(_rank, args=(_free_port(), out, size, list(plans)), nprocs=2, start_method="spawn")
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(2)]
    return [list(peaks) for peaks in zip(*per_rank, strict=True)]


def measure(size: Size, schedules: Sequence[str] = ("gpipe", "1f1b"), ranks: bool = True) -> list[Row]:
    """One process under GPipe, and 2 ranks under each of ``schedules``."""
    model, x, y = _model(size)
    prof = autopipe.profile(model, (x,), chunks=size.chunks, loss_fn=_lm_loss, target=y, repeats=2)
    rows = []
    plan = autopipe.partition(prof, stages=2, chunks=size.chunks, recompute="never", optimizer="adamw",
                              runtime="gpipe", devices=["cpu", "cpu"])
    rows.append(Row("one process", "gpipe", "process", _one_process(size, plan), sum(plan.device_memory.values())))
    plans = [autopipe.partition(prof, stages=2, chunks=size.chunks, recompute="never", optimizer="adamw",
                                schedule=schedule, runtime="distributed", bandwidth=None)
             for schedule in (schedules if ranks else ())]
    for plan, peaks in zip(plans, _ranks(size, plans) if plans else [], strict=True):
        for r, peak in enumerate(peaks):
            rows.append(Row("2 ranks", plan.schedule, f"rank {r}", peak, plan.peak_memory[r]))
    return rows


def binding(size: Size, schedule: str = "1f1b", fraction: float = 0.85) -> tuple[int, list[Row]]:
    """A memory limit that binds: ``fraction`` of the largest rank peak the plan without one
    predicts; that plan and the one made under the limit (recompute="auto") run on 2 ranks.
    Returns the limit and the rows (``runtime`` says which plan)."""
    model, x, y = _model(size)
    prof = autopipe.profile(model, (x,), chunks=size.chunks, loss_fn=_lm_loss, target=y, repeats=2)
    free = autopipe.partition(prof, stages=2, chunks=size.chunks, recompute="never", optimizer="adamw",
                              schedule=schedule, runtime="distributed", bandwidth=None)
    limit = int(max(free.peak_memory) * fraction)
    bound = autopipe.partition(prof, stages=2, chunks=size.chunks, recompute="auto", optimizer="adamw",
                               schedule=schedule, runtime="distributed", bandwidth=None, memory_limit=limit)
    rows = []
    for name, plan, peaks in zip(("no limit", "under the limit"), (free, bound), _ranks(size, [free, bound]),
                                 strict=True):
        for r, peak in enumerate(peaks):
            rows.append(Row(f"{name} ({plan.stage_recompute[r]})", schedule, f"rank {r}", peak,
                            plan.peak_memory[r]))
    return limit, rows


def table(rows: Sequence[Row]) -> str:
    lines = ["| runtime | schedule | where | peak MiB measured | peak MiB predicted | measured / predicted |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.runtime} | {r.schedule} | {r.where} | {r.measured / 2**20:.2f} | "
                     f"{r.predicted / 2**20:.2f} | {r.ratio:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vocab", type=int, default=Size.vocab)
    parser.add_argument("--batch", type=int, default=Size.batch)
    parser.add_argument("--dim", type=int, default=Size.dim)
    parser.add_argument("--layers", type=int, default=Size.layers)
    parser.add_argument("--seq", type=int, default=Size.seq)
    parser.add_argument("--bind", type=float, metavar="FRACTION",
                        help="plan 1F1B under this fraction of the unlimited plan's largest rank peak "
                             "and run both plans on 2 ranks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = Size(vocab=args.vocab, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
    if args.bind is not None:
        limit, rows = binding(size, fraction=args.bind)
        print(f"memory limit {limit / 2**20:.2f} MiB; measured over it: "
              f"{', '.join(f'{r.runtime} {r.where}' for r in rows if r.measured > limit) or 'none'}")
    else:
        rows = measure(size)
    print(f"TinyGPT vocab {size.vocab}, dim {size.dim}, {size.layers} layers, seq {size.seq}, batch "
          f"{size.batch} in {size.chunks} micro-batches, 2 stages, AdamW; torch {torch.__version__}")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
