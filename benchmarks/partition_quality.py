"""Partition quality: bottleneck / lower bound and / optimum for dp, ilp and the baselines.

    python benchmarks/partition_quality.py            # prints a markdown table

Cases: random cost lists, a GPT-like list (embedding 1, 24 blocks of 10, head 30) at K = 4 and
8, a transformer DAG with residual skips, and the bundled examples' measured profiles
(profiles/*.csv) when they exist. ``blockpartition`` is torchgpipe's own algorithm (imported
from torchgpipe). "optimum" is the ILP's proven optimum (gap <= 0.5%) or, on chains, the DP's.
"""

from __future__ import annotations

import argparse
import glob
from collections.abc import Sequence

import numpy as np

from autopipe.core.profile_table import Profile
from autopipe.errors import AutopipeError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import chain_profile, transformer_dag

__all__ = ["main", "cases"]

METHODS = ("dp", "ilp", "uniform", "params", "blockpartition")


def cases(random_n: int, seeds: int, gpt_blocks: int, dag_blocks: int) -> list[tuple[str, Profile, int]]:
    out: list[tuple[str, Profile, int]] = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        costs = rng.integers(1, 100, random_n).astype(float).tolist()
        out.append((f"random-{random_n} (seed {seed})",
                    chain_profile(costs, param_bytes=rng.integers(1, 1000, random_n).tolist()), 4))
    gpt = [1.0] + [10.0] * gpt_blocks + [30.0]
    params = [50] + [12] * gpt_blocks + [50]
    for k in (4, 8):
        out.append((f"gpt-like 1+{gpt_blocks}x10+30", chain_profile(gpt, param_bytes=params), k))
    out.append((f"transformer DAG ({8 * dag_blocks + 2} layers)", transformer_dag(dag_blocks), 4))
    for path in sorted(glob.glob("profiles/*.csv")):
        try:
            out.append((path, Profile.load(path), 4))
        except AutopipeError as err:
            print(f"skipping {path}: {err}")
    return out


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--random-n", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--gpt-blocks", type=int, default=24)
    ap.add_argument("--dag-blocks", type=int, default=12)
    ap.add_argument("--time-limit", type=float, default=60)
    args = ap.parse_args(argv)
    if not glob.glob("profiles/*.csv"):
        print("no profiles/*.csv yet: the bundled examples' rows are skipped (run `autopipe profile`)")
    header = "| case | K | " + " | ".join(f"{m} /LB /opt" for m in METHODS) + " |"
    lines = [header, "|" + "---|" * (len(METHODS) + 2)]
    for name, prof, k in cases(args.random_n, args.seeds, args.gpt_blocks, args.dag_blocks):
        if k > len(prof):
            continue
        opts = dict(chunks=8, recompute="never", bandwidth=None) if name.startswith(("random", "gpt")) \
            else dict(chunks=8, recompute="except_last", bandwidth=10e9)
        plans = {}
        for method in METHODS:
            try:
                plans[method] = partition(prof, stages=k, method=method, time_limit=args.time_limit, **opts)
            except AutopipeError as err:
                print(f"{name} {method}: {err}")
        optimum = min(p.bottleneck for m, p in plans.items() if m in ("dp", "ilp"))
        cells = []
        for method in METHODS:
            p = plans.get(method)
            cells.append("n/a" if p is None else
                         f"{p.bottleneck:.1f} / {p.bottleneck / p.lower_bound:.3f} / {p.bottleneck / optimum:.3f}")
        lines.append(f"| {name} | {k} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
