"""The shortest step against the smallest slowest stage, on seeded random chains (simulated).

    python benchmarks/step_split.py                       # 20 chains of 8-16 layers per schedule
    python benchmarks/step_split.py --chains 4            # fewer

For each schedule (GPipe, 1F1B, interleaved 1F1B and ZB-V, 4 stages on 4 devices or 2 ranks as
each lays them out, 8 micro-batches, no recomputation) and each seeded random chain of 8-16
layers with a split backward (autopipe.solvers.synthetic.random_chain), three plans are timed by
autopipe.core.simulator: ``partition(method="exact")`` (the min-max DP), ``method="step"``
([Note: the step, not the bottleneck] in autopipe/solvers/step_split.py), and the fastest of
every split of the layer order, each evaluated by ``Plan.from_stages`` on its own (the truth).
The table gives, per schedule, how often and by how much the DP's split is slower than the
fastest, and the same for "step" (0 when it found the fastest).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain

LAYOUTS = {"gpipe": None, "1f1b": None, "interleaved1f1b": ["r0", "r1", "r0", "r1"],
           "zbv": ["r0", "r1", "r1", "r0"]}


def fastest_of_every_split(prof: Profile, like: Plan) -> float:
    """The shortest simulated step over every contiguous split, each evaluated on its own."""
    layers, best = prof.layers, float("inf")
    for cuts in itertools.combinations(range(1, len(layers)), like.num_stages - 1):
        bounds = (0, *cuts, len(layers))
        plan = Plan.from_stages(prof, [layers[a:b] for a, b in itertools.pairwise(bounds)],
                                devices=like.devices, chunks=like.chunks, schedule=like.schedule,
                                recompute=like.recompute)
        best = min(best, plan.iteration_time)
    return best


def rows(chains: int) -> list[tuple[str, int, int, float, float, int, float]]:
    """Per schedule: chains, DP slower (count, median %, max %), step slower (count, max %)."""
    out = []
    for schedule, devices in LAYOUTS.items():
        dp_over, step_over = [], []
        for seed in range(chains):
            prof = random_chain(8 + seed % 9, seed, split=True)
            kw: dict[str, Any] = dict(stages=4, devices=devices, chunks=8, schedule=schedule, recompute="never")
            exact, step = partition(prof, method="exact", **kw), partition(prof, method="step", **kw)
            truth = fastest_of_every_split(prof, exact)
            dp_over.append(100 * (exact.iteration_time / truth - 1))
            step_over.append(100 * (step.iteration_time / truth - 1))
        slower = [x for x in dp_over if x > 1e-9]
        out.append((schedule, len(slower), chains, statistics.median(slower) if slower else 0.0,
                    max(dp_over), sum(x > 1e-9 for x in step_over), max(step_over)))
    return out


def table(data: Sequence[tuple[str, int, int, float, float, int, float]]) -> str:
    lines = ["| schedule | DP's split slower than the fastest | median, when slower | worst | "
             "step's split slower | worst |", "|---|---:|---:|---:|---:|---:|"]
    for schedule, slower, chains, median, worst, step_slower, step_worst in data:
        lines.append(f"| {schedule} | {slower} of {chains} | {median:.2f}% | {worst:.2f}% | "
                     f"{step_slower} of {chains} | {step_worst:.2f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=20, help="seeded chains per schedule (default 20)")
    args = p.parse_args(argv)
    cpu = platform.processor() or platform.machine()
    head = (f"python benchmarks/step_split.py {' '.join(argv)}".rstrip() + "\n"
            f"{cpu}, {os.cpu_count()} cores, {datetime.date.today().isoformat()} (simulated)")
    out = head + "\n\n" + table(rows(args.chains))
    print(out)
    return out


if __name__ == "__main__":
    main()
