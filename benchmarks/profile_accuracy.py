"""How close is a profile to the truth? Sum of per-layer times vs. one whole-model step.

For each bundled example, profile one micro-batch (autopipe.profile) and time a whole-model
forward + backward of the same micro-batch (autopipe.frontend.profiling.profiler.time_model) on the same machine in
the same run, alternating the two for several rounds so that load from other processes hits
both alike. Prints a markdown table; the ratio column is

    sum over layers of (fwd_ms + bwd_ms)  /  whole-model (fwd_ms + bwd_ms)

(median over rounds). 1.00 is perfect; the target is within 15% (0.85 .. 1.15). Two clocks:
``wall`` (time.perf_counter, what the profiler uses on CPU) and ``cpu`` (time.process_time: this
process's CPU time, which other processes on a shared machine cannot inflate). Wall-clock sums
and whole-model times react differently to a loaded machine: a layer's median of short calls
skips most preemptions, one long whole-model step does not.

    python3 benchmarks/profile_accuracy.py                 # all examples, 1 thread
    python3 benchmarks/profile_accuracy.py --examples mlp --rounds 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from autopipe.examples import EXAMPLES, get_example
from autopipe.frontend.profiling.harness.timing import CpuTimer
from autopipe.frontend.profiling.profiler import profile, time_model
from executor.host_allocator import use_host_allocator

__all__ = ["main", "SETTINGS"]

# example -> (batch size, chunks): micro-batches big enough that layers do real work. The
# committed profiles/NAME.csv use the same settings:
#   autopipe profile NAME --batch-size B --chunks 4 --threads 1 --repeats 20 --warmup 3 --out profiles/NAME.csv
SETTINGS: dict[str, tuple[int, int]] = {"mlp": (256, 4), "cnn": (64, 4), "gpt": (32, 4), "unet": (32, 4)}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _measure(name: str, rounds: int, repeats: int, warmup: int) -> dict[str, float]:
    batch, chunks = SETTINGS[name]
    ex = get_example(name, batch)
    sums: dict[str, list[float]] = {c: [] for c in CLOCKS}
    wholes: dict[str, list[float]] = {c: [] for c in CLOCKS}
    layers = 0
    for _ in range(rounds):
        for clock, fn in CLOCKS.items():
            timer = CpuTimer(fn)
            prof = profile(
                ex.model, ex.inputs, chunks=chunks, repeats=repeats, warmup=warmup, timer=timer
            )
            fwd, bwd = time_model(
                ex.model, ex.inputs, chunks=chunks, repeats=repeats, warmup=warmup, timer=timer
            )
            sums[clock].append(float(prof.df["fwd_ms"].sum() + prof.df["bwd_ms"].sum()))
            wholes[clock].append(fwd + bwd)
            layers = len(prof)
    out: dict[str, float] = {"layers": layers, "micro": -(-batch // chunks)}
    for clock in CLOCKS:
        out[f"sum_{clock}"] = statistics.median(sums[clock])
        out[f"whole_{clock}"] = statistics.median(wholes[clock])
        out[f"ratio_{clock}"] = statistics.median(s / w for s, w in zip(sums[clock], wholes[clock], strict=True))
    return out


def main(argv: Sequence[str] | None = None) -> str:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=list(SETTINGS), choices=sorted(EXAMPLES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [
        "| example | layers | micro-batch | sum of layers, ms (wall) | whole model, ms (wall) "
        "| ratio (wall) | ratio (cpu time) | within 15% (wall / cpu) |",
        "|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name in args.examples:
        r = _measure(name, args.rounds, args.repeats, args.warmup)
        ok = ["yes" if abs(r[f"ratio_{c}"] - 1) <= 0.15 else "no" for c in CLOCKS]
        rows.append(
            f"| {name} | {r['layers']:.0f} | {r['micro']:.0f} | {r['sum_wall']:.3f} "
            f"| {r['whole_wall']:.3f} | {r['ratio_wall']:.2f} | {r['ratio_cpu']:.2f} | {' / '.join(ok)} |"
        )
    table = "\n".join(rows)
    print(table)
    print(
        f"\ncpu, {args.threads} thread(s), torch {torch.__version__}, {args.rounds} rounds x "
        f"{args.repeats} repeats (+{args.warmup} warm-up) per clock, median over rounds, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        file=sys.stderr,
    )
    return table


if __name__ == "__main__":
    main()
