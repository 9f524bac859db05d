"""Measured executor.GPipe iteration time vs the simulator's prediction for the same plan.

For each bundled example: profile one micro-batch (once per model), then for every checkpoint
mode partition for ``--stages`` CPU stages (one device, so the simulator serialises them:
[Note: shared devices]), build the pipeline, and time full training iterations (forward +
backward over the mini-batch). The prediction includes the overheads the profiler measures
([Note: measured overheads] in autopipe/core/cost.py); ``--no-overheads`` drops them from the
profile, which gives the prediction of the model without them. Also times the same
micro-batches run through the same stage modules by a plain Python loop, which separates the
cost of micro-batching itself from the runtime's scheduling overhead. Prints a markdown table
of medians and ratios (measured / predicted; target within 10%).

This machine's speed drifts by up to a third within seconds, so ``--rounds`` (default 3)
repeats the whole measurement: each round profiles the model anew and then runs every plan,
and a row gives the median over the rounds of each run against the profile taken just before
it, with the spread.

    python3 benchmarks/executor_vs_prediction.py --threads 1
    python3 benchmarks/executor_vs_prediction.py --runtime distributed   # 2 gloo ranks

``--runtime distributed`` runs each plan on two gloo ranks of one thread each
(executor.DistributedPipeline, GPipe): the plan is made for two devices (two ranks are two
devices, not one shared CPU), from a profile that carries the transfer between two ranks and
the distributed runtime's own call cost, measured once by autopipe.frontend.profiling.spawned.comm ([Note:
measured transfer]); "before" then drops those and the recompute ratio (the model before any
measured overhead: no call cost, bandwidth 1e10), and "plain loop" is ONE process running the
model over the same micro-batches, so "executor / loop" is the inverse of the 2-rank speedup.
``--schedules gpipe 1f1b`` runs torch's 1F1B beside GPipe there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import autopipe
from autopipe.app.train import median_ms
from autopipe.core.profile_table import Profile
from autopipe.examples import Example, get_example
from autopipe.frontend.profiling.spawned.comm import (
    COMM_LAUNCHES,
    COMM_REPEATS,
    EMPTY_STEPS,
    with_comm,
)
from autopipe.frontend.profiling.spawned.ports import free_port
from autopipe.frontend.profiling.spawned.rank_contention import with_rank_contention
from executor.host_allocator import use_host_allocator
from executor.ranks.rank_cores import pin_local_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from forked_ranks import start_ranks  # noqa: E402 - after the path it is found on

__all__ = ["Row", "main"]


@dataclass
class Row:
    """One plan's prediction and measurement, once per round (a fresh profile each round)."""

    model: str
    batch: int
    chunks: int
    recompute: str
    schedule: str = "gpipe"
    predicted: list[float] = field(default_factory=list)
    measured: list[float] = field(default_factory=list)
    loop: list[float] = field(default_factory=list)  # the same micro-batches by a plain loop
    before: list[float] = field(default_factory=list)  # the plan predicted without the overheads

    def add(self, predicted: float, measured: float, loop: float, before: float) -> None:
        self.predicted.append(predicted)
        self.measured.append(measured)
        self.loop.append(loop)
        self.before.append(before)

    @property
    def predicted_ms(self) -> float:
        return statistics.median(self.predicted)

    @property
    def measured_ms(self) -> float:
        return statistics.median(self.measured)

    @property
    def loop_ms(self) -> float:
        return statistics.median(self.loop)

    @property
    def before_ms(self) -> float:
        return statistics.median(self.before)

    @property
    def ratios(self) -> list[float]:
        """measured / predicted of each round: a run against the profile taken just before it."""
        return [m / p for m, p in zip(self.measured, self.predicted, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def before_ratio(self) -> float:
        return statistics.median(m / b for m, b in zip(self.measured, self.before, strict=True))


# the Corrections fields left out for the "before" predictions, as they were before measuring
OVERHEADS: dict[str, Any] = {"loss": None, "stage_calls": {}, "recompute_ratio": 1.0, "recompute_call_ms": 0.0}
COMM: dict[str, Any] = {"transfer": None,  # [Note: measured transfer]
                        "rank_compute_slowdown": None}  # [Note: ranks sharing a host]


def _without(prof: Profile, fields: dict[str, Any]) -> Profile:
    return dataclasses.replace(prof, corrections=dataclasses.replace(prof.corrections, **fields))


def _rank(rank: int, port: int, out: str, name: str, batch: int, chunks: int,
          plans: list[dict[str, Any]], repeats: int) -> None:
    """Every plan in turn on this rank: a fresh model each (a pipeline frees the others' parts)."""
    from autopipe.assemble.ranks import distributed_pipeline

    torch.set_num_threads(1)
    pin_local_rank(rank, 2)  # as `autopipe run` places its ranks
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    times = []
    for plan in plans:
        ex = get_example(name, batch_size=batch)
        pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, chunks=chunks,
                                    plan=autopipe.Plan.from_dict(plan), host_allocator="retain")
        dist.barrier()
        times.append(median_ms(functools.partial(pipe.step, *ex.inputs, target=ex.target), repeats, warmup=2))
    torch.save(times, Path(out) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _profile(ex: Example, chunks: int, repeats: int, device: str = "cpu") -> Profile:
    """As `autopipe profile` measures an example: its layers, then its loss."""
    return autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=max(3, repeats // 2),
                            device=device, loss_fn=ex.loss_fn, target=ex.target)


def measure_distributed(name: str, batch: int, chunks: int, checkpoints: Sequence[str],
                        repeats: int, comm: dict[str, Any], schedules: Sequence[str] = ("gpipe",),
                        rounds: int = 1) -> list[Row]:
    """Every recompute mode x schedule of one example on 2 gloo ranks, predicted for two
    devices; each round profiles anew, then runs every plan."""
    ex = get_example(name, batch_size=batch)
    devices = ["cpu:0", "cpu:1"]  # two ranks: two devices
    rows = [Row(name, batch, chunks, c, s) for s in schedules for c in checkpoints]
    pieces = list(zip(*(torch.tensor_split(x, chunks) for x in ex.inputs), strict=True))
    targets = torch.tensor_split(ex.target, chunks)

    def loop() -> None:
        for inputs, target in zip(pieces, targets, strict=True):
            ex.loss_fn(ex.model(*inputs), target).backward()

    for _ in range(rounds):
        prof = with_rank_contention(_profile(ex, chunks, repeats), ex.model, ex.inputs)  # as --comm does
        prof = with_comm(prof, measured=comm)  # the one measurement, reused
        plans = [autopipe.partition(prof, devices=devices, chunks=chunks, recompute=r.recompute,
                                    schedule=r.schedule) for r in rows]
        port = free_port()  # [Note: a rendezvous port]
        with tempfile.TemporaryDirectory() as out:
            start_ranks(_rank, (port, out, name, batch, chunks, [p.to_dict() for p in plans], repeats), 2)
            per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(2)]
        loop_ms = median_ms(loop, repeats, warmup=2)
        bare = _without(prof, {**OVERHEADS, **COMM})
        for row, plan, a, b in zip(rows, plans, *per_rank, strict=True):
            before = autopipe.Plan.from_stages(bare, plan.stages, devices=devices, chunks=chunks,
                                               recompute=row.recompute, schedule=row.schedule)
            row.add(plan.iteration_time, max(a, b), loop_ms, before.iteration_time)
    return rows


def measure_model(name: str, batch: int, chunks: int, checkpoints: Sequence[str], stages: int,
                  repeats: int, overheads: bool = True, device: str = "cpu", rounds: int = 1) -> list[Row]:
    """Every recompute mode of one example (on ``device``); each round profiles anew, then
    runs every mode, so each measurement is compared with a profile taken seconds before."""
    ex = get_example(name, batch_size=batch)
    ex = Example(ex.name, ex.model, tuple(x.to(device) for x in ex.inputs), ex.target.to(device),
                 ex.loss_fn)
    rows = [Row(name, int(ex.inputs[0].shape[0]), chunks, c) for c in checkpoints]
    for _ in range(rounds):
        prof = _profile(ex, chunks, repeats, device)
        if not overheads:
            prof = _without(prof, OVERHEADS)
        for row in rows:
            row.add(*measure(ex, prof, chunks, row.recompute, stages, repeats, device))
    return rows


def measure(ex: Example, prof: Profile, chunks: int, recompute: str, stages: int,
            repeats: int, device: str = "cpu") -> tuple[float, float, float, float]:
    """(predicted, measured, plain loop, predicted without the overheads) ms of one plan."""
    devices = [device] * stages  # one device: the stages take turns ([Note: shared devices])
    plan = autopipe.partition(prof, devices=devices, chunks=chunks, recompute=recompute)
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=devices, chunks=chunks,
                             recompute=recompute, plan=plan)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    pieces = list(zip(*(torch.tensor_split(x, chunks) for x in ex.inputs), strict=True))
    targets = torch.tensor_split(ex.target, chunks)

    def step() -> None:
        ex.loss_fn(pipe(*ex.inputs), ex.target).backward()
        sync()

    def loop() -> None:
        for inputs, target in zip(pieces, targets, strict=True):
            out: object = inputs
            for stage in pipe.stages:
                out = stage(*out) if isinstance(out, tuple) else stage(out)
            ex.loss_fn(out, target).backward()  # type: ignore[arg-type]
        sync()

    bare = _without(prof, OVERHEADS)
    before = autopipe.Plan.from_stages(bare, plan.stages, devices=devices, chunks=chunks,
                                       recompute=recompute)
    return (plan.iteration_time, median_ms(step, repeats, warmup=2), median_ms(loop, repeats, warmup=2),
            before.iteration_time)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "unet"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--checkpoints", nargs="+", default=["never", "except_last", "always"])
    parser.add_argument("--schedules", nargs="+", default=["gpipe"], choices=["gpipe", "1f1b"],
                        help="--runtime distributed: the schedules to run (executor.GPipe is gpipe)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3,
                        help="profile anew and measure every plan this many times; the table holds "
                             "the medians and the spread of measured / predicted over the rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the stages run")
    parser.add_argument("--no-overheads", action="store_true",
                        help="predict without the measured overheads (the model before them)")
    parser.add_argument("--runtime", choices=["gpipe", "distributed"], default="gpipe",
                        help="executor.GPipe in this process (default), or 2 gloo ranks")
    parser.add_argument("--comm-launches", type=int, default=COMM_LAUNCHES,
                        help="measure_comm's launches of two ranks (a smoke run: 1)")
    parser.add_argument("--comm-repeats", type=int, default=COMM_REPEATS, help="measure_comm's repeats per size")
    parser.add_argument("--comm-steps", type=int, default=EMPTY_STEPS,
                        help="measure_comm's steps of its empty pipelines")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.runtime == "distributed":
        from autopipe.frontend.profiling.spawned.comm import measure_comm

        comm = measure_comm("cpu", chunks=args.chunks, launches=args.comm_launches,
                            repeats=args.comm_repeats, steps=args.comm_steps)
        print(f"between two ranks: {comm['comm_latency_ms']:.3f} ms + bytes / "
              f"{(comm['comm_bandwidth'] or float('inf')) / 1e9:.2f} GB/s, the receiver "
              f"{comm['comm_receive_share']} x the bytes' time again; stage call "
              f"{comm['stage_call_fwd_ms']:.3f} + {comm['stage_call_bwd_ms']:.3f} ms (1f1b: "
              f"{comm['stage_call_1f1b_fwd_ms']:.3f} + {comm['stage_call_1f1b_bwd_ms']:.3f} ms)")
        rows = [r for m in args.models
                for r in measure_distributed(m, args.batch, args.chunks, args.checkpoints, args.repeats,
                                             comm, args.schedules, args.rounds)]
        print(table(rows))
        return rows
    if args.schedules != ["gpipe"]:
        parser.error("executor.GPipe runs gpipe only: --schedules 1f1b needs --runtime distributed")
    rows = [r for m in args.models
            for r in measure_model(m, args.batch, args.chunks, args.checkpoints, args.stages,
                                   args.repeats, overheads=not args.no_overheads, device=args.device,
                                   rounds=args.rounds)]
    print(table(rows))
    return rows


def table(rows: Sequence[Row]) -> str:
    """The markdown table: medians over the rounds, and the spread of measured / predicted;
    ``before`` = the same plan predicted without the measured overheads."""
    lines = ["| model | batch | chunks | schedule | checkpoint | predicted ms | measured ms | "
             "measured / predicted | over rounds | before: predicted ms | before: measured / predicted | "
             "plain loop ms | executor / loop |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.batch} | {r.chunks} | {r.schedule} | {r.recompute} | "
                     f"{r.predicted_ms:.3f} | {r.measured_ms:.3f} | {r.ratio:.3f} | "
                     f"{min(r.ratios):.2f}-{max(r.ratios):.2f} | "
                     f"{r.before_ms:.3f} | {r.before_ratio:.3f} | {r.loop_ms:.3f} | "
                     f"{r.measured_ms / r.loop_ms:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
