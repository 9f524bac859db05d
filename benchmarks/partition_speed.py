"""Partition solve time vs N (layers) and K (stages), for the DP and the ILP.

    python benchmarks/partition_speed.py              # prints markdown tables

DP on random chains of N layers (targets: N = 2000, K = 16 under 2 s); ILP on transformer
training DAGs (8 x blocks + 2 layers, residual skips, tied head) warm-started from the DP
(target: ~200 layers into 6 stages proven optimal, gap <= 0.5%, under 10 s).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from autopipe.core.cost import DeviceSpec, LayerCosts
from autopipe.core.cost_options import CostOptions
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.ilp import solve_ilp
from autopipe.solvers.synthetic import random_chain, transformer_dag

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dp-n", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--dp-k", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--ilp-blocks", type=int, nargs="+", default=[6, 12, 25])
    ap.add_argument("--ilp-k", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--time-limit", type=float, default=60)
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    main()
