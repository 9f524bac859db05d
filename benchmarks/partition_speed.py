"""Partition solve time vs N (layers) and K (stages), for the DP and the ILP; and the default.

    python benchmarks/partition_speed.py              # prints markdown tables
    python benchmarks/partition_speed.py --default --profile llama1b:16 --repeats 3

DP on random chains of N layers (targets: N = 2000, K = 16 under 2 s); ILP on transformer
training DAGs (8 x blocks + 2 layers, residual skips, tied head) warm-started from the DP
(target: ~200 layers into 6 stages proven optimal, gap <= 0.5%, under 10 s).

``--default`` times ``partition()`` as a user calls it (method="auto": the DP, then the
shortest step, [Note: the step, not the bottleneck] in autopipe/solvers/step_split.py) instead:
an 802-layer random chain with a split backward into 16 stages, 16 micro-batches, under GPipe, 1F1B, interleaved 1F1B
and ZB-V; each saved profile of ``--profile NAME:K`` into K stages at its own micro-batches
(``benchmarks/giant.py --save-profile NAME`` writes the HF Llama shapes); and the automatic
search (stages, chunks, recompute and schedule all "auto") over an 802-layer transformer DAG
with a split backward on 16 devices. Each the median of ``--repeats`` runs in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import solve_ilp
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain, transformer_dag

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dp-n", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--dp-k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--ilp-blocks", type=int, nargs="+", default=[6, 12, 25])
    ap.add_argument("--ilp-k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--time-limit", type=float, default=60)
    ap.add_argument("--default", action="store_true", help="time partition()'s default instead")
    ap.add_argument("--profile", nargs="*", default=[], metavar="NAME:K", help="with --default: a saved profile, K stages")
    ap.add_argument("--repeats", type=int, default=3, help="with --default: runs per case (the median)")
    args = ap.parse_args(argv)
    if args.default:
        table = default_table(args.profile, args.repeats)
        print(table)
        return table
    opts = CostOptions(bandwidth=10e9)
    lines = ["| solver | N | K | seconds | bottleneck ms | gap |", "|---|---|---|---|---|---|"]
    for n in args.dp_n:
        lc = LayerCosts.from_profile(random_chain(n, 0))
        for k in args.dp_k:
            if k > n:
                continue
            start = time.perf_counter()
            r = solve_dp(lc, [DeviceSpec(f"d{s}") for s in range(k)], opts)
            lines.append(f"| dp | {n} | {k} | {time.perf_counter() - start:.3f} | {r.bottleneck:.2f} | 0 |")
    for blocks in args.ilp_blocks:
        lc = LayerCosts.from_profile(transformer_dag(blocks))
        for k in args.ilp_k:
            devices = [DeviceSpec(f"d{s}") for s in range(k)]
            start = time.perf_counter()
            dp = solve_dp(lc, devices, opts)
            r = solve_ilp(lc, devices, opts, warm_start=dp.assignment, time_limit=args.time_limit)
            lines.append(f"| ilp ({r.status}) | {len(lc)} | {k} | {time.perf_counter() - start:.3f} | "
                         f"{r.objective:.2f} | {100 * r.gap:.2f}% |")
    table = "\n".join(lines)
    print(table)
    return table


def default_table(profiles: Sequence[str], repeats: int) -> str:
    """``partition()``'s default, timed on the cases of ``--default`` (see the module's doc)."""
    chain = random_chain(802, 3, split=True)
    dag = transformer_dag(100, split=True)
    dag.meta.update(micro_batch_size=8, batch_size=64, chunks=8)
    cases: list[tuple[str, Callable[[], Plan]]] = [
        (f"random chain, {len(chain)} layers, 16 stages, {s}",
         lambda s=s: partition(chain, stages=16, chunks=16, schedule=s, progress=False))
        for s in ("gpipe", "1f1b", "interleaved1f1b", "zbv")]
    for spec in profiles:
        name, k = spec.rsplit(":", 1)
        prof = Profile.load(name)
        cases.append((f"{prof.meta.get('model', name)}, {len(prof)} layers, {k} stages",
                      lambda p=prof, k=int(k): partition(p, stages=k, progress=False)))
    cases.append((f"search: transformer DAG, {len(dag)} layers with the split, 16 devices, all auto",
                  lambda: partition(dag, devices=[f"cuda:{i}" for i in range(16)], stages="auto", chunks="auto",
                                    recompute="auto", schedule="auto", progress=False)))
    lines = ["| case | seconds (median) | runs | plan | solver | gap |", "|---|---:|---|---|---|---:|"]
    for name, run in cases:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan = run()
            times.append(time.perf_counter() - start)
        gap = "" if plan.solver.gap is None else f"{100 * plan.solver.gap:.2f}%"
        lines.append(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} | "
                     f"{plan.method}, {plan.schedule}, {plan.num_stages} x {plan.chunks}, "
                     f"{plan.iteration_time:.1f} ms | {plan.solver.status} | {gap} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
