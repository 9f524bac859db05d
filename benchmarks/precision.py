"""fp32 vs bf16 mixed precision: step time and peak memory, measured and predicted, in one
process and on 2 gloo ranks.

    python3 benchmarks/precision.py                  # both runtimes, both precisions
    python3 benchmarks/precision.py --tiny --runtimes one   # seconds (the test adds --method uniform)

The model is the bundled GPT (autopipe.examples.TinyGPT, its head tied to its embedding) at
the size given (``--vocab --dim --layers --seq --batch``). For each precision (``fp32``,
``bf16``: fp32 master weights, every stage under autocast, [Note: mixed precision] in
executor/precision.py):

- profile it under that precision (``autopipe.profile(precision=)``, with the loss), partition
  it into 2 stages (``partition`` plans under the profile's precision: [Note: mixed precision
  memory] in autopipe/core/cost.py);
- one process (executor.GPipe, both stages on the one CPU, so they take turns: [Note: shared
  devices]): in a FRESH spawned process per precision ([Note: RssAnon]: on a CPU what a run
  takes is its process's anonymous resident memory), build the pipeline from the plan, time
  ``--repeats`` training iterations (forward + backward, what the plan predicts) after
  ``--warmup``, an Adam step after each (untimed, so that its state exists as the plan
  assumes). Measured peak = the highest RssAnon over the steps minus the level before the model
  was built; predicted = the simulated peak of the device (both stages' parameters, gradients,
  Adam state, activations);
- the activations alone: one iteration in this process under executor.activation_meter's
  ActivationMeter (what autograd keeps for backward, per stage, the loss left outside as
  benchmarks/memory_vs_prediction.py does), against ``plan.breakdown[s].activation_bytes``.
  Bytes do not depend on the machine's load: one run is exact;
- 2 ranks (``distributed_pipeline(precision=)``, gloo, one thread and one core each, as
  ``autopipe run`` places them): planned for two devices from the same profile plus the
  measured transfer and rank contention ([Note: measured transfer], [Note: ranks sharing a
  host]; measured once, shared by both precisions); each rank's step time and its own peak
  RssAnon, as above, against the plan's stage on that rank.

Ratios: measured / predicted, and bf16 / fp32 of the measured and of the predicted numbers. A
CPU without native bf16 matrix units runs bf16 matmuls slower than fp32; the table says what
this one does, not what a GPU would.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import start_processes

import autopipe
from autopipe.core.plan import Plan
from autopipe.core.simulator import simulate
from autopipe.examples import Example, TinyGPT
from autopipe.frontend.profiling.harness.process_memory import PeakRss, rss_anon
from autopipe.frontend.profiling.spawned.ports import free_port
from executor.activation_meter import ActivationMeter
from executor.host_allocator import use_host_allocator
from executor.ranks.rank_cores import pin_local_rank

__all__ = ["ActivationRow", "Row", "main"]

PRECISIONS = ("fp32", "bf16")
RUNTIMES = ("one", "ranks")
TINY = {"vocab": 64, "dim": 32, "layers": 2, "seq": 16, "batch": 8, "chunks": 2, "repeats": 2, "warmup": 1}


@dataclass(frozen=True)
class Size:
    vocab: int
    dim: int
    layers: int
    seq: int
    batch: int


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def example(size: Size) -> Example:
    """The bundled GPT at ``size``, seeded: the same model and batch in every process."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyGPT(vocab=size.vocab, dim=size.dim, heads=4, layers=size.layers, max_len=size.seq)
        ids = torch.randint(0, size.vocab, (size.batch, size.seq))
        target = torch.randint(0, size.vocab, (size.batch, size.seq))
    return Example("gpt", model, (ids,), target, _lm_loss)


@dataclass
class Row:
    """One runtime's place (the process, or one rank) under one precision."""

    runtime: str  # "one process" | "2 ranks"
    where: str  # "process" | "rank 0" | "rank 1"
    precision: str
    predicted_ms: float
    predicted_peak: int
    cut: str  # stage 1's first layer
    times: list[float] = field(default_factory=list)  # ms of each timed iteration
    peak: int | None = None  # measured: RssAnon peak over the steps minus the level before the
    # model, in a fresh process; None: run in this process (--in-process), where it means nothing

    @property
    def measured_ms(self) -> float:
        return statistics.median(self.times)

    @property
    def ratio_ms(self) -> float:
        return self.measured_ms / self.predicted_ms

    @property
    def ratio_peak(self) -> float | None:
        return None if self.peak is None else self.peak / self.predicted_peak


@dataclass(frozen=True)
class ActivationRow:
    precision: str
    stage: int
    predicted: int
    measured: int

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def _run_steps(step: Any, after: Any, repeats: int, warmup: int, base: int | None) -> tuple[list[float], int]:
    """``warmup`` + ``repeats`` iterations (``after`` untimed after each) under PeakRss: the
    timed ms and the peak above ``base``."""
    times = []
    with PeakRss() as peak:
        for i in range(warmup + repeats):
            start = time.perf_counter()
            step()
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
            after()
    above = (peak.bytes or 0) - (base or 0)
    return times, above


def _warm(precision: str) -> int | None:
    """Load what every run loads once (the tracer's modules, the kernels of each dtype) on a
    model of a few thousand parameters, then the RssAnon level: the base the model's peak is
    measured from, so that a tiny model is not charged the libraries' memory."""
    small = example(Size(**{k: v for k, v in TINY.items() if k in Size.__dataclass_fields__}))
    autopipe.trace(small.model, small.inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = small.loss_fn(small.model(*small.inputs).float(), small.target)
    loss.backward()
    del small, loss
    gc.collect()
    return rss_anon()


def _one_process(index: int, out: str, size: Size, plan: dict[str, Any], repeats: int, warmup: int) -> None:
    """A fresh process: build the pipeline from ``plan``, time its iterations, its peak memory."""
    use_host_allocator("retain")
    torch.set_num_threads(1)
    base = _warm(plan["precision"])
    ex = example(size)
    p = Plan.from_dict(plan)
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * len(p.stages), loss_fn=ex.loss_fn,
                             chunks=p.chunks, recompute=p.recompute, plan=p, precision=p.precision,
                             host_allocator="retain")
    opt = torch.optim.Adam(ex.model.parameters(), lr=1e-4)

    def after() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay, as the plan counts them

    times, peak = _run_steps(lambda: pipe(*ex.inputs, target=ex.target).backward(), after,
                             repeats, warmup, base)
    torch.save((times, peak), Path(out) / f"{index}.pt")


def _rank(rank: int, port: int, out: str, size: Size, plan: dict[str, Any], repeats: int, warmup: int) -> None:
    """One of 2 gloo ranks (a fresh process): its stage of ``plan``, step times, peak memory."""
    from autopipe.assemble.ranks import distributed_pipeline

    use_host_allocator("retain")
    torch.set_num_threads(1)
    pin_local_rank(rank, 2)  # as `autopipe run` places its ranks
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=300))
    base = _warm(plan["precision"])
    ex = example(size)
    p = Plan.from_dict(plan)
    pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, chunks=p.chunks, plan=p,
                                precision=p.precision, host_allocator="retain", timeout=300)
    opt = torch.optim.Adam(pipe.stage_module.parameters(), lr=1e-4)

    def after() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)

    dist.barrier()
    times, peak = _run_steps(lambda: pipe.step(*ex.inputs, target=ex.target), after, repeats, warmup, base)
    torch.save((times, peak), Path(out) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _spawn(fn: Any, nprocs: int, args: tuple[Any, ...]) -> list[tuple[list[float], int]]:
    with tempfile.TemporaryDirectory() as out:
        start_processes(fn, args=(out, *args) if nprocs == 1 else (free_port(), out, *args),
                        nprocs=nprocs, start_method="spawn")
        return [torch.load(Path(out) / f"{i}.pt") for i in range(nprocs)]


def activations(ex: Example, plan: Plan) -> list[int]:
    """Per stage: the bytes autograd keeps at its peak in one iteration (the loss outside)."""
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * len(plan.stages), chunks=plan.chunks,
                             recompute=plan.recompute, plan=plan, precision=plan.precision,
                             host_allocator="retain")
    meter = ActivationMeter(list(pipe.stages), inputs=ex.inputs)
    with meter:
        out = pipe(*ex.inputs)
        with meter.outside():
            loss = ex.loss_fn(out.float(), ex.target)
        loss.backward()
    ex.model.zero_grad(set_to_none=True)
    return list(meter.peaks)


def _plan(prof: Any, devices: list[str], chunks: int, recompute: str, first: Plan | None,
          method: str = "auto") -> Plan:
    """``partition``'s 2-stage plan (by ``method``), or under ``first``'s split (the first
    precision's plan), so that every precision is compared on the same stages."""
    if first is None:
        return autopipe.partition(prof, devices=devices, chunks=chunks, recompute=recompute, method=method)
    return Plan.from_stages(prof, first.stages, devices=devices, chunks=chunks, recompute=recompute,
                            bandwidth=first.bandwidth)


def measure(size: Size, precisions: Sequence[str], runtimes: Sequence[str], chunks: int, recompute: str,
            repeats: int, warmup: int, profile_repeats: int,
            in_process: bool = False, method: str = "auto") -> tuple[list[Row], list[ActivationRow]]:
    rows: list[Row] = []
    acts: list[ActivationRow] = []
    comm: dict[str, Any] | None = None
    first: dict[str, Plan] = {}  # runtime -> the first precision's plan, whose split all share
    if "ranks" in runtimes:
        from autopipe.frontend.profiling.spawned.comm import measure_comm

        comm = measure_comm("cpu", chunks=chunks)
    for precision in precisions:
        ex = example(size)
        prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=profile_repeats,
                                warmup=0 if profile_repeats == 1 else 1, progress=False, precision=precision,
                                loss_fn=ex.loss_fn, target=ex.target, host_allocator="retain")
        if "one" in runtimes:
            plan = _plan(prof, ["cpu", "cpu"], chunks, recompute, first.get("one"), method)
            first.setdefault("one", plan)
            acts += [ActivationRow(precision, s, int(b.activation_bytes), m)
                     for s, (b, m) in enumerate(zip(plan.breakdown, activations(ex, plan), strict=True))]
            run = (size, plan.to_dict(), repeats, warmup)
            if in_process:
                with tempfile.TemporaryDirectory() as out:
                    _one_process(0, out, *run)
                    times, _ = torch.load(Path(out) / "0.pt")
                peak = None
            else:
                [(times, peak)] = _spawn(_one_process, 1, run)
            rows.append(Row("one process", "process", precision, plan.iteration_time,
                            simulate(plan).device_memory["cpu"], plan.stages[1][0], times, peak))
        if comm is not None:
            from autopipe.frontend.profiling.spawned.comm import with_comm

            ranked = with_comm(prof, measured=comm, model=ex.model, example_inputs=ex.inputs)
            plan = _plan(ranked, ["cpu:0", "cpu:1"], chunks, recompute, first.get("ranks"), method)
            first.setdefault("ranks", plan)
            per_rank = _spawn(_rank, 2, (size, plan.to_dict(), repeats, warmup))
            rows += [Row("2 ranks", f"rank {r}", precision, plan.iteration_time, plan.peak_memory[r],
                         plan.stages[1][0], times, peak) for r, (times, peak) in enumerate(per_rank)]
    return rows, acts


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(a: int | None, b: int | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def _baseline(rows: Sequence[Any], row: Any, key: str) -> Any:
    """The fp32 row of the same place as ``row`` (None if fp32 was not measured)."""
    return next((r for r in rows if r.precision == "fp32"
                 and getattr(r, key) == getattr(row, key)
                 and getattr(r, "runtime", None) == getattr(row, "runtime", None)), None)


def table(rows: Sequence[Row]) -> str:
    """Step time and peak memory: measured (median, min-max over the timed iterations),
    predicted, their ratio, and bf16 / fp32 of each."""
    lines = ["| runtime | where | stage 1 from | precision | step ms measured | min-max | step ms predicted | "
             "measured / predicted | peak MiB measured | peak MiB predicted | measured / predicted | "
             "bf16/fp32 step measured | bf16/fp32 step predicted | bf16/fp32 peak measured | "
             "bf16/fp32 peak predicted |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = _baseline(rows, r, "where")
        ratios = ["-"] * 4 if base is None or r.precision == "fp32" else [
            f"{r.measured_ms / base.measured_ms:.2f}", f"{r.predicted_ms / base.predicted_ms:.2f}",
            _ratio(r.peak, base.peak), f"{r.predicted_peak / base.predicted_peak:.2f}"]
        lines.append(f"| {r.runtime} | {r.where} | {r.cut} | {r.precision} | {r.measured_ms:.1f} | "
                     f"{min(r.times):.1f}-{max(r.times):.1f} | {r.predicted_ms:.1f} | {r.ratio_ms:.2f} | "
                     f"{'-' if r.peak is None else _mib(r.peak)} | {_mib(r.predicted_peak)} | "
                     f"{_ratio(r.peak, r.predicted_peak)} | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def activation_table(rows: Sequence[ActivationRow]) -> str:
    lines = ["| precision | stage | activation KiB predicted | measured (ActivationMeter) | "
             "measured / predicted | bf16/fp32 measured | bf16/fp32 predicted |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = _baseline(rows, r, "stage")
        ratios = ["-"] * 2 if base is None or r.precision == "fp32" else [
            f"{r.measured / base.measured:.2f}", f"{r.predicted / base.predicted:.2f}"]
        lines.append(f"| {r.precision} | {r.stage} | {r.predicted / 1024:.1f} | {r.measured / 1024:.1f} | "
                     f"{r.ratio:.3f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def environment(note: str = "") -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return (f"torch {torch.__version__}, {cpu}, {os.cpu_count()} cores{load}, "
            f"{datetime.date.today().isoformat()}" + (f"; {note}" if note else ""))


def main(argv: Sequence[str] | None = None) -> tuple[list[Row], list[ActivationRow]]:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--recompute", default="except_last",
                        choices=["never", "except_last", "always"])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES,
                        help="one: executor.GPipe in one process; ranks: 2 gloo ranks")
    parser.add_argument("--repeats", type=int, default=7, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true",
                        help="a model of a few thousand parameters, 2 iterations, one profile repeat")
    parser.add_argument("--in-process", action="store_true",
                        help="run the one-process pipeline here, not in a fresh process: faster, "
                             "but its peak memory is then this process's (the profiles' included)")
    parser.add_argument("--method", default="auto",
                        help="partition's method for the split (default: the planner's own, from the "
                             "profiled times); 'uniform' splits by layer count, the same split under "
                             "any load (the test's)")
    parser.add_argument("--note", default="", help="added to the environment line (the machine's load)")
    args = parser.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
        args.profile_repeats = 1
    torch.set_num_threads(1)
    size = Size(args.vocab, args.dim, args.layers, args.seq, args.batch)
    rows, acts = measure(size, args.precisions, args.runtimes, args.chunks, args.recompute,
                         args.repeats, args.warmup, args.profile_repeats, args.in_process, args.method)
    print(f"GPT vocab {size.vocab}, dim {size.dim}, {size.layers} layers, seq {size.seq}, batch "
          f"{size.batch}, {args.chunks} micro-batches, recompute={args.recompute}, 2 stages, "
          f"1 thread per process; {args.repeats} timed iterations after {args.warmup}")
    print(environment(args.note))
    print()
    print(table(rows))
    print()
    print(activation_table(acts))
    return rows, acts


if __name__ == "__main__":
    main()
