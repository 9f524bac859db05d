"""Zero-bubble schedules against 1F1B and interleaved 1F1B, planned at the same memory (simulated).

    python benchmarks/zero_bubble_plan.py                    # 202-layer DAG + TinyLlama-1.1B's shape
    python benchmarks/zero_bubble_plan.py --no-llama         # the synthetic DAG only (no torch)
    python benchmarks/zero_bubble_plan.py --llama-profile profiles/llama1b   # profile once, reuse

For each profile, K pipeline ranks (``--ranks``, default 4 and 8) and M micro-batches (``--multiples
x K``, default K, 2K and 4K) of one global batch (``--batch-per-rank`` x K rows), and each memory
limit (none, then ``--fractions`` of what the fastest 1F1B plan at M = K needs on its fullest
device), every schedule is planned on the K ranks with ``partition(devices=K ranks, chunks=M,
recompute="auto", schedule=...)``: the exact DP split, a recomputation mode per stage, the
schedule's own layout (one stage per rank under 1F1B; two under interleaved 1F1B and the
zero-bubble schedules, in a V for ZBV and DualPipeV: [Note: stage to rank] in executor/spec.py),
timed by autopipe.core.simulator in torch 2.13's order. The table gives the best of 1F1B and
interleaved 1F1B, the best of interleaved_zb, zbv and dualpipev, and the speedup of the latter.
The distributed runtime runs them (benchmarks/distributed_speedup.py measures ZB-V on 2 ranks); this
table is the planner's alone, at scales this machine cannot run.

The DAG is autopipe.solvers.synthetic's, with a split backward (half of a weighted layer's
backward on its input gradients; [Note: split backward time] in autopipe/core/cost.py); the
Llama-1B-class profile is measured layer by layer on a model built on the meta device, as
benchmarks/auto_plan.py does (torch and transformers needed), its split measured with torch's
own halves of a backward ([Note: split backward measured] in
autopipe/frontend/profiling/harness/backward_split.py). Times are the profiled device's (one CPU for the
Llama profile); no transfer or call cost is measured for either, so both pay the partitioner's
default bandwidth and no stage call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import transformer_dag
from executor.spec import ZERO_BUBBLE_SCHEDULES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from auto_plan import add_llama_arguments, llama_profile  # noqa: E402 - after the path it is found on

__all__ = ["main", "Row", "rows_for", "table"]

ONE_F_ONE_B = ("1f1b", "interleaved1f1b")


@dataclass
class Row:
    profile: str
    ranks: int
    chunks: int
    limit: int | None
    baseline: Plan | None  # the best of 1F1B and interleaved 1F1B; None: nothing fits
    zero_bubble: Plan | None  # the best zero-bubble plan


def _best(prof: Profile, schedules: Sequence[str], ranks: int, chunks: int, batch: int,
          limit: int | None) -> Plan | None:
    """The fastest simulated plan among ``schedules`` on ``ranks`` ranks at M = ``chunks``."""
    best = None
    for schedule in schedules:
        try:
            plan = partition(prof, devices=[f"rank{r}" for r in range(ranks)], chunks=chunks, batch_size=batch,
                             recompute="auto", schedule=schedule, memory_limit=limit, method="exact",
                             progress=False)
        except AutopipeError:
            continue  # this schedule takes no such count, or nothing fits
        if best is None or plan.iteration_time < best.iteration_time:
            best = plan
    return best


def _peak(plan: Plan) -> int:
    return max([*plan.device_memory.values(), *plan.stage_memory])


def rows_for(name: str, prof: Profile, ranks: Sequence[int], multiples: Sequence[int], per_rank: int,
             fractions: Sequence[float]) -> list[Row]:
    rows = []
    for k in ranks:
        batch = per_rank * k
        base = _best(prof, ONE_F_ONE_B, k, k, batch, None)
        if base is None:
            print(f"{name}: no 1F1B plan on {k} ranks", file=sys.stderr)
            continue
        limits: list[int | None] = [None]
        for fraction in fractions:
            limit = int(_peak(base) * fraction)
            limits.append(limit >> 20 << 20 if limit >= 1 << 24 else limit)  # whole MiB for real sizes
        for m in (k * x for x in multiples):
            for limit in limits:
                rows.append(Row(name, k, m, limit, _best(prof, ONE_F_ONE_B, k, m, batch, limit),
                                _best(prof, ZERO_BUBBLE_SCHEDULES, k, m, batch, limit)))
    return rows


def _cell(plan: Plan | None) -> str:
    if plan is None:
        return "none fits | "
    return f"{plan.schedule}, {plan.num_stages} stages | {plan.iteration_time:.1f}"


def table(rows: Sequence[Row]) -> str:
    lines = ["| profile | ranks K | M | memory limit | best 1F1B / interleaved | ms | best zero bubble | ms | "
             "speedup | peak memory, 1F1B -> zero bubble |",
             "|---|---:|---:|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        b, z = r.baseline, r.zero_bubble
        speedup = f"{b.iteration_time / z.iteration_time:.3f}x" if b and z else ""
        memory = f"{format_bytes(_peak(b))} -> {format_bytes(_peak(z))}" if b and z else ""
        limit = "none" if r.limit is None else format_bytes(r.limit)
        lines.append(f"| {r.profile} | {r.ranks} | {r.chunks} | {limit} | {_cell(b)} | {_cell(z)} | "
                     f"{speedup} | {memory} |")
    return "\n".join(lines)


def environment(argv: Sequence[str]) -> str:
    """The command, the machine and the date, printed with the table."""
    import numpy

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = f"torch {torch.__version__}, "
    except ImportError:
        torch_version = ""
    return (f"python benchmarks/zero_bubble_plan.py {' '.join(argv)}".rstrip() + "\n"
            f"{torch_version}numpy {numpy.__version__}, {cpu}, {os.cpu_count()} cores, "
            f"{datetime.date.today().isoformat()} (simulated)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4], help="M as multiples of K")
    p.add_argument("--batch-per-rank", type=int, default=16, help="the global batch is this x K rows")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.7],
                   help="memory limits besides none, as fractions of the best 1F1B plan's peak at M = K")
    p.add_argument("--dag-blocks", type=int, default=25, help="8 x blocks + 2 layers")
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--llama-profile", default=None, help="NAME: read NAME.csv if it exists, else write it")
    add_llama_arguments(p)  # TinyLlama-1.1B's shape, as benchmarks/auto_plan.py profiles it
    return p


def main(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    dag = transformer_dag(args.dag_blocks, hidden_bytes=4 << 20, split=True)
    dag.meta.update(micro_batch_size=2, batch_size=16, chunks=8)
    profiles = [(f"transformer DAG, {len(dag)} layers", dag)]
    if not args.no_llama:
        prof = llama_profile(args)
        profiles.append((f"Llama {args.layers} x {args.hidden}, {len(prof)} layers", prof))
    rows = [row for name, prof in profiles
            for row in rows_for(name, prof, args.ranks, args.multiples, args.batch_per_rank, args.fractions)]
    out = environment(argv) + "\n\n" + table(rows)
    print(out)
    return out


if __name__ == "__main__":
    main()
