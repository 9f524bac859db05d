"""Two-process pipeline vs one process, auto plan vs equal layer counts, vs plain pipelining.

    python benchmarks/distributed_speedup.py            # prints markdown tables

Two models, each trained on one mini-batch of ``--batch`` rows in ``--chunks`` micro-batches,
one CPU thread per process, gloo: the bundled uneven MLP (autopipe.examples.UnevenMLP, layers
16x apart in cost) and ``EvenBlocks``, 16 equal Linear(W, W) + ReLU blocks (``--width`` W) that
split evenly, so that the runtime's own overhead is what separates it from the ideal:

- one process: the plain model over the same micro-batches (loss = their mean, as the
  pipeline computes it), so the ideal 2-stage GPipe speedup is 2M / (M + 1);
- autopipe, auto plan: ``distributed_pipeline`` with the plan ``partition`` makes from a
  profile measured here (1 thread);
- autopipe, equal layers: the same runtime with ``method="uniform"`` (equal layer counts);
- torch.distributed.pipelining by hand: the peer. ``nn.Sequential`` slices cut by hand at
  the auto plan's cut (so this row isolates the runtime's overhead from the plan), wrapped in
  ``PipelineStage`` + ``ScheduleGPipe``: what a user writes without autopipe.

Then ZB-V and DualPipeV against 1F1B on the same 2 ranks, for each model at each of
``--zb-chunks`` (M = 4 and 8): the plans ``partition`` makes from a profile taken as ``autopipe
profile --comm`` takes it (split backward, loss, link, call costs, ranks' slowdown), 1F1B on 2
stages, ``schedule="zbv"`` and ``"dualpipev"`` on 4 in a V (rank r holding stages r and 3 - r;
backwards split into input and weight gradients, executor/ranks/split_backward.py, but where no other
rank waits: [Note: adjacent I and W] in executor/spec.py); each against one process and
2M/(M+1), and the simulator's prediction of each against 1F1B. That table runs in ``--zb-rounds``
rounds on the same process group (one process, the plain model on rank 0's pinned core while rank
1 waits; 1F1B; each V plan), its ratios taken within each round: the host's noise, which moves
step times by up to 1.5x between runs, moves both terms of a ratio.

Timings are medians of ``--steps`` steps after ``--warmup`` steps; ratios are what matter.
Then the distributed runtime's overhead per micro-batch, from autopipe.frontend.profiling.spawned.comm (what
``autopipe profile --comm`` stores for the cost model): a stage call of the runtime (empty
stages: schedule, PipelineStage, Python) and a gloo crossing of each model's activation, next to
the gap each model's measured step leaves to its ideal, per micro-batch slot.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopipe.frontend.profiling.spawned.comm import COMM_LAUNCHES, COMM_REPEATS, EMPTY_STEPS
from autopipe.frontend.profiling.spawned.ports import free_port
from executor.host_allocator import use_host_allocator
from executor.ranks.rank_cores import pin_local_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from forked_ranks import start_ranks  # noqa: E402 - after the path it is found on

__all__ = ["EvenBlocks", "main"]
MODELS = ("uneven", "even")


class EvenBlocks(nn.Module):
    """``blocks`` equal Linear(width, width) + ReLU blocks, as one flat ``net`` (net.0 .. net.31)."""

    def __init__(self, width: int, blocks: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _example(model: str, batch: int, width: int) -> Any:
    from autopipe.examples import Example, get_example

    if model == "uneven":
        return get_example("mlp", batch_size=batch)
    torch.manual_seed(0)
    return Example("even", EvenBlocks(width), (torch.randn(batch, width),),
                   torch.randint(0, width, (batch,)), F.cross_entropy)


def _median_ms(step: Callable[[], object], steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _single_process_step(model: str, batch: int, width: int, chunks: int) -> Callable[[], None]:
    """One training step of the plain model over the pipeline's micro-batches (loss = their mean)."""
    ex = _example(model, batch, width)
    xs, ys = ex.inputs[0].tensor_split(chunks), ex.target.tensor_split(chunks)

    def step() -> None:
        ex.model.zero_grad()
        torch.stack([ex.loss_fn(ex.model(x), y) for x, y in zip(xs, ys, strict=True)]).mean().backward()

    return step


def _single_process(model: str, batch: int, width: int, chunks: int, steps: int, warmup: int) -> float:
    return _median_ms(_single_process_step(model, batch, width, chunks), steps, warmup)


def _autopipe_pipeline(plan: dict[str, Any], model: str, batch: int, width: int, chunks: int,
                       schedule: str | None = None) -> Callable[[], object]:
    """This rank's step of ``distributed_pipeline`` under ``plan`` on the example."""
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    ex = _example(model, batch, width)
    pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, plan=Plan.from_dict(plan),
                                chunks=chunks, recompute="never", host_allocator="retain", schedule=schedule)
    return lambda: pipe.step(*ex.inputs, target=ex.target)


def _autopipe_rank(rank: int, plan: dict[str, Any], model: str, batch: int, width: int, chunks: int,
                   steps: int, warmup: int) -> float:
    return _median_ms(_autopipe_pipeline(plan, model, batch, width, chunks), steps, warmup)


def _torch_rank(rank: int, cut: int, model: str, batch: int, width: int, chunks: int, steps: int,
                warmup: int) -> float:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    ex = _example(model, batch, width)
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


Schedules = list[tuple[dict[str, Any], str]]  # (plan, schedule) of one M's row of the ZB-V table
Paired = list[tuple[tuple[Any, ...], Schedules]]  # each M's run and its 1F1B, ZB-V and DualPipeV plans


def _rank(rank: int, plans: list[dict[str, Any]], cut: int, run: tuple[Any, ...], paired: Paired,
          rounds: int) -> list[float]:
    """Every 2-rank configuration in turn on one process group (one start-up for them all): the
    plans, the hand-written peer, then ``paired`` in rounds (:func:`_paired_rounds`)."""
    times = [_autopipe_rank(rank, plan, *run) for plan in plans]
    dist.barrier()
    times.append(_torch_rank(rank, cut, *run))
    for group_run, schedules in paired:
        times += _paired_rounds(rank, group_run, schedules, rounds)
    return times


def _paired_rounds(rank: int, run: tuple[Any, ...], schedules: Schedules, rounds: int) -> list[float]:
    """``rounds`` rounds of: the plain model on rank 0 alone (rank 1 idle in a barrier, so one
    process on one pinned core, as each rank is), then each of ``schedules`` on both ranks; each
    a median of ``ceil(steps / rounds)`` steps after one warm-up step. Per round: [one process
    (0.0 on rank 1), *schedules]. A speedup is then a ratio within a round: the host's noise,
    which moves one run's step times by up to 1.5x from the next's, moves both of its terms."""
    model, batch, width, chunks, steps, warmup = run
    pipes = []
    for plan, schedule in schedules:
        pipes.append(_autopipe_pipeline(plan, model, batch, width, chunks, schedule))
        for _ in range(warmup):
            pipes[-1]()
    one = _single_process_step(model, batch, width, chunks) if rank == 0 else None  # rank 1 waits meanwhile
    if one is not None:
        for _ in range(warmup):
            one()
    each = -(-steps // rounds)
    times = []
    for _ in range(rounds):
        dist.barrier()
        times.append(0.0 if one is None else _median_ms(one, each, 1))
        dist.barrier()
        times += [_median_ms(step, each, 1) for step in pipes]
    return times


def _entry(rank: int, port: int, out: str, fn: Callable[..., list[float]], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    pin_local_rank(rank, 2)  # as `autopipe run` places its ranks
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    times = fn(rank, *args)
    dist.barrier()
    torch.save(times, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _two_ranks(fn: Callable[..., list[float]], *args: Any) -> list[float]:
    """Step times of each 2-rank run of ``fn``: the slower rank's median (both wait for each other)."""
    port = free_port()  # [Note: a rendezvous port]
    with tempfile.TemporaryDirectory() as out:
        start_ranks(_entry, (port, out, fn, args), 2)
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(2)]
    return [max(a, b) for a, b in zip(*per_rank, strict=True)]


@functools.cache
def _profile(model: str, batch: int, width: int, chunks: int) -> Any:
    from autopipe.frontend.profiling.profiler import profile

    ex = _example(model, batch, width)
    return profile(ex.model, ex.inputs, chunks=chunks, repeats=5)


def _plans(model: str, batch: int, width: int, chunks: int) -> tuple[Any, Any]:
    from autopipe.solvers.partitioner import partition

    prof = _profile(model, batch, width, chunks)
    return (partition(prof, stages=2, chunks=chunks, recompute="never"),
            partition(prof, stages=2, chunks=chunks, recompute="never", method="uniform"))


def _model_table(model: str, args: argparse.Namespace) -> tuple[list[str], tuple[float, float, int], list[str]]:
    """One model's markdown table; its one-process and best autopipe step ms, the cut's bytes;
    its rows of the ZB-V table (run by the same two ranks)."""
    m, run = args.chunks, (model, args.batch, args.width, args.chunks, args.steps, args.warmup)
    auto, uniform = _plans(model, args.batch, args.width, args.chunks)
    cut = int(auto.stages[1][0].split(".")[-1])  # layers are net.0, net.1, ...
    one = _single_process(*run)
    paired, zb_rows = _zero_bubble_runs(model, args)
    auto_ms, uniform_ms, peer_ms, *zb_times = _two_ranks(_rank, [auto.to_dict(), uniform.to_dict()], cut, run,
                                                         paired, args.zb_rounds)
    rows = [
        ("one process (1 thread)", "-", one),
        ("autopipe, auto plan", _split(auto.stages), auto_ms),
        ("autopipe, equal layer counts", _split(uniform.stages), uniform_ms),
        ("torch.distributed.pipelining, hand split", f"net[:{cut}] / net[{cut}:]", peer_ms),
    ]
    ideal = 2 * m / (m + 1)
    name = "UnevenMLP" if model == "uneven" else f"EvenBlocks (16 x Linear({args.width}, {args.width}) + ReLU)"
    lines = [
        f"{name}, batch {args.batch}, M={m} micro-batches, 2 gloo ranks x 1 thread, "
        f"GPipe, no recomputation; ideal 2-stage speedup 2M/(M+1) = {ideal:.2f}",
        "",
        "| run | split (layers per stage) | step ms | speedup vs one process | of ideal |",
        "|---|---|---:|---:|---:|",
    ]
    for label, split, ms in rows:
        of_ideal = "-" if ms is one else f"{one / ms / ideal:.0%}"
        lines.append(f"| {label} | {split} | {ms:.1f} | {one / ms:.2f}x | {of_ideal} |")
    lines.append("")
    lines.append(f"auto plan vs equal layer counts: {uniform_ms / auto_ms:.2f}x faster; "
                 f"vs the hand-written torch.distributed.pipelining peer: {peer_ms / auto_ms:.2f}x")
    best = min((auto_ms, auto), (uniform_ms, uniform), key=lambda x: x[0])
    short = "UnevenMLP" if model == "uneven" else "EvenBlocks"
    zb = []
    each = 2 + 2 * len(ZB_SCHEDULES)  # one process, 1F1B, each schedule under its rule, then under the other
    rounds = [zb_times[k:k + each] for k in range(0, len(zb_times), each)]
    for n, (m, predicted, splits) in enumerate(zb_rows):
        per_round = rounds[n * args.zb_rounds:(n + 1) * args.zb_rounds]
        medians = [f"{statistics.median(t[i] for t in per_round):.1f}" for i in range(each)]
        for i, (schedule, guess, split) in enumerate(zip(ZB_SCHEDULES * 2, predicted, splits, strict=True), 2):
            zb.append(f"| {short} | {m} | {ZB_NAMES[schedule]} | {split} | {medians[0]} | {medians[1]} | {medians[i]} | "
                      f"{_ratio(per_round, 1, i)} | {guess} | {_ratio(per_round, 0, 1)} | {_ratio(per_round, 0, i)} | "
                      f"{2 * m / (m + 1):.2f} |")
    return lines, (one, best[0], best[1].breakdown[0].output_bytes), zb


def _planned_profile(model: str, args: argparse.Namespace, chunks: int) -> Any:
    """As ``autopipe profile --comm`` measures ``model`` for ``chunks`` micro-batches: its
    layers (with the split backward), its loss, the link and the runtime's call costs under
    every schedule, and how much slower a rank computes beside the other."""
    import autopipe
    from autopipe.frontend.profiling.spawned.comm import with_comm

    ex = _example(model, args.batch, args.width)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=5, loss_fn=ex.loss_fn, target=ex.target)
    comm = _comm(chunks, args.comm_launches, args.comm_repeats, args.comm_steps)
    return with_comm(prof, measured=comm, model=ex.model, example_inputs=ex.inputs)


@functools.cache
def _comm(chunks: int, launches: int, repeats: int, steps: int) -> dict[str, Any]:
    """One measurement of the link and the runtime's calls at ``chunks`` micro-batches, shared
    by the models' plans and the overhead table."""
    from autopipe.frontend.profiling.spawned.comm import measure_comm

    return measure_comm("cpu", chunks=chunks, launches=launches, repeats=repeats, steps=steps)


ZB_SCHEDULES = ("zbv", "dualpipev")  # measured against 1F1B on the same 2 ranks
ZB_NAMES = {"zbv": "ZB-V", "dualpipev": "DualPipeV"}


def _zero_bubble_runs(model: str, args: argparse.Namespace) -> tuple[Paired, list[tuple[int, list[str], list[str]]]]:
    """``model``'s 1F1B plan and one plan of each of ``ZB_SCHEDULES`` at each M of
    ``--zb-chunks``, as ``partition`` makes them for 2 ranks from a ``--comm`` profile: 2
    stages, and 4 in a V (rank 0: stages 0 and 3), for :func:`_paired_rounds`; each M's
    simulator's 1F1B / schedule ratio and the V's split, per schedule."""
    from autopipe.core.simulator import simulate
    from autopipe.solvers.partitioner import partition

    paired: Paired = []
    rows = []
    for m in args.zb_chunks:
        run = (model, args.batch, args.width, m, args.steps, args.warmup)
        prof = _planned_profile(model, args, m)
        two = partition(prof, devices=["cpu:0", "cpu:1"], chunks=m, recompute="never", schedule="1f1b")
        fours = [partition(prof, stages=4, chunks=m, recompute="never", schedule=s) for s in ZB_SCHEDULES]
        # each plan also under the merge rule it did not choose: the choice measured, not only simulated
        fours += [dataclasses.replace(p, merge_backward="adjacent" if p.merge_backward == "unwaited" else "unwaited")
                  for p in fours]
        paired.append((run, [(two.to_dict(), "1f1b"), *((p.to_dict(), p.schedule) for p in fours)]))
        rows.append((m, [f"{two.iteration_time / simulate(p, prof).iteration_time:.2f}x" for p in fours],
                     ["/".join(str(len(s)) for s in p.stages)
                      + f" ({p.merge_backward}{'' if n < len(ZB_SCHEDULES) else ', not chosen'})"
                      for n, p in enumerate(fours)]))
    return paired, rows


def _ratio(per_round: list[list[float]], num: int, den: int) -> str:
    """The median over rounds of entry ``num`` / entry ``den``, and their range where there is
    more than one round."""
    ratios = [t[num] / t[den] for t in per_round]
    mid = f"{statistics.median(ratios):.2f}x"
    return mid if len(ratios) == 1 else f"{mid} ({min(ratios):.2f}-{max(ratios):.2f})"


def _zero_bubble_table(args: argparse.Namespace, rows: list[str]) -> list[str]:
    return [
        f"ZB-V and DualPipeV against 1F1B, batch {args.batch}, 2 gloo ranks x 1 thread, no recomputation: "
        "each the plan `partition` makes from a `--comm` profile (with the split backward and the loss), "
        "1F1B on 2 stages, the others on 4 in a V (rank 0: stages 0 and 3, rank 1: 1 and 2; layers per "
        "stage in the V column), each backward split into input and weight gradients but where the plan's "
        "merge rule runs adjacent halves whole (in brackets: unwaited, where no other rank waits for them; "
        "adjacent, all; each plan also run under the rule it did not choose); predicted: the simulator's "
        "1F1B / schedule iteration ratio of the plans. In rounds: one process (the plain model on rank 0's core), 1F1B, "
        f"then each V plan, {args.zb_rounds} times; step ms: the median over rounds, ratios: the median of the "
        "rounds' ratios (their range in brackets)",
        "",
        "| model | M | schedule | V split (merge) | one process step ms | 1F1B step ms | step ms | vs 1F1B | predicted "
        "| 1F1B speedup | speedup | 2M/(M+1) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]


def _overheads(args: argparse.Namespace, steps: dict[str, tuple[float, float, int]]) -> list[str]:
    """The runtime's overhead per micro-batch next to each model's gap to its ideal."""
    comm = _comm(args.chunks, args.comm_launches, args.comm_repeats, args.comm_steps)
    m, latency, bandwidth = args.chunks, comm["comm_latency_ms"], comm["comm_bandwidth"] or float("inf")
    call = comm["stage_call_fwd_ms"] + comm["stage_call_bwd_ms"]
    lines = [
        f"Distributed runtime overhead per micro-batch (autopipe.frontend.profiling.spawned.comm, {comm['comm_backend']}): "
        f"a stage call (empty stages: schedule, PipelineStage, Python) {comm['stage_call_fwd_ms']:.3f} ms "
        f"forward + {comm['stage_call_bwd_ms']:.3f} ms backward; a crossing {latency:.3f} ms + bytes / "
        f"{bandwidth / 1e9:.2f} GB/s (ping-pong medians {[round(t, 3) for t in comm['comm_ms']]} ms at "
        f"{comm['comm_sizes']} bytes)",
        "",
        "| model | activation per micro-batch | crossing ms | call + crossing ms (per stage, micro-batch) "
        "| ideal step ms | measured step ms | gap per micro-batch slot ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, (one, best, nbytes) in steps.items():
        crossing = latency + nbytes * 1000.0 / bandwidth
        ideal = one * (m + 1) / (2 * m)
        lines.append(f"| {model} | {nbytes >> 10} KiB | {crossing:.3f} | {call + crossing:.3f} | "
                     f"{ideal:.1f} | {best:.1f} | {(best - ideal) / (m + 1):.3f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> str:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--width", type=int, default=512, help="EvenBlocks' width W")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-overheads", action="store_true", help="skip the overhead breakdown")
    p.add_argument("--zb-chunks", type=int, nargs="*", default=[4, 8],
                   help="the M of the ZB-V against 1F1B table (none: no table)")
    p.add_argument("--zb-rounds", type=int, default=5,
                   help="rounds of the ZB-V table: its --steps split among them, each round one process, then 1F1B, "
                        "then each V plan; a speedup is the median of the rounds' ratios (their range in brackets)")
    p.add_argument("--comm-launches", type=int, default=COMM_LAUNCHES,
                   help="measure_comm's launches of two ranks (a smoke run: 1)")
    p.add_argument("--comm-repeats", type=int, default=COMM_REPEATS, help="measure_comm's repeats per size")
    p.add_argument("--comm-steps", type=int, default=EMPTY_STEPS, help="measure_comm's steps of its empty pipelines")
    args = p.parse_args(argv)
    if args.zb_rounds < 1 or args.steps < 1:
        p.error(f"--zb-rounds {args.zb_rounds} --steps {args.steps}: need at least 1 of each")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lines: list[str] = []
    steps: dict[str, tuple[float, float, int]] = {}
    zb: list[str] = []
    for model in args.models:
        table, steps[model], rows = _model_table(model, args)
        lines += [*table, ""]
        zb += rows
    if zb:
        lines += [*_zero_bubble_table(args, zb), ""]
    if not args.no_overheads:
        lines += _overheads(args, steps)
    text = "\n".join(lines)
    print(text)
    return text


def _split(stages: list[list[str]]) -> str:
    return " / ".join(f"{s[0]}..{s[-1]} ({len(s)})" for s in stages)


if __name__ == "__main__":
    main()
