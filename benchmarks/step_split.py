"""The split autopipe returns against the fastest of every split, on seeded random chains and on
the workloads of torch's auto_partition tests (simulated).

    python benchmarks/step_split.py                       # 20 chains of 8-16 layers per schedule
    python benchmarks/step_split.py --chains 4            # fewer
    python benchmarks/step_split.py --chains 0            # torch's workloads only

Every plan is timed by autopipe.core.simulator, and the truth is the fastest of every contiguous
split of the layer order, each evaluated by ``Plan.from_stages`` on its own. Per split:
``partition()`` (the default, method="auto"), ``method="step"`` ([Note: the step, not the
bottleneck] in autopipe/solvers/step_split.py), ``method="exact"`` (the min-max DP), and torch's
``auto_partition`` as a peer (benchmarks/torch_moves.py): its DP's split, and the fastest split
its refinement's moves reach, which is no slower than the one it would return.

The first table: for each schedule (GPipe, 1F1B, interleaved 1F1B and ZB-V, 4 stages on 4
devices or 2 ranks as each lays them out, 8 micro-batches, no recomputation) and each seeded
random chain of 8-16 layers with a split backward (autopipe.solvers.synthetic.random_chain), how
many of the chains each plan is slower than the fastest on, and by how much at worst (% of the
fastest step). The second: torch's workloads (autopipe.solvers.synthetic.torch_workloads, 4
ranks, 8 micro-batches) under each schedule that has fewer stages than layers (GPipe and 1F1B: 4
stages; interleaved 1F1B, interleaved zero bubble and ZB-V: 8, two on each rank), each plan's
step over the fastest.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import Workload, random_chain, torch_workloads

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from torch_moves import fastest_reachable  # noqa: E402 - after the path it is found on

LAYOUTS = {"gpipe": None, "1f1b": None, "interleaved1f1b": ["r0", "r1", "r0", "r1"],
           "zbv": ["r0", "r1", "r1", "r0"]}
PLANS = ("default", "step", "exact", "torch's DP", "torch's moves")
# torch's workloads: each schedule's stages on 4 ranks
RANKED = {"gpipe": ["r0", "r1", "r2", "r3"], "1f1b": ["r0", "r1", "r2", "r3"],
          "interleaved1f1b": ["r0", "r1", "r2", "r3"] * 2, "interleaved_zb": ["r0", "r1", "r2", "r3"] * 2,
          "zbv": ["r0", "r1", "r2", "r3", "r3", "r2", "r1", "r0"]}


def fastest_of_every_split(prof: Profile, like: Plan) -> float:
    """The shortest simulated step over every contiguous split, each evaluated on its own."""
    layers, best = prof.layers, float("inf")
    for cuts in itertools.combinations(range(1, len(layers)), like.num_stages - 1):
        bounds = (0, *cuts, len(layers))
        plan = Plan.from_stages(prof, [layers[a:b] for a, b in itertools.pairwise(bounds)],
                                devices=like.devices, chunks=like.chunks, schedule=like.schedule,
                                recompute=like.recompute, bandwidth=like.bandwidth)
        best = min(best, plan.iteration_time)
    return best


def over_fastest(prof: Profile, kw: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The fastest split's step (ms) and how much slower each of PLANS is (%)."""
    plans = {"default": partition(prof, **kw), "step": partition(prof, method="step", **kw),
             "exact": partition(prof, method="exact", **kw)}
    plans["torch's DP"], plans["torch's moves"], _ = fastest_reachable(prof, plans["exact"])
    truth = fastest_of_every_split(prof, plans["exact"])
    return truth, {name: 100 * (p.iteration_time / truth - 1) for name, p in plans.items()}


def chain_rows(chains: int) -> list[tuple[str, int, dict[str, list[float]]]]:
    """Per schedule: the chains, and each plan's % over the fastest on every chain."""
    out = []
    for schedule, devices in LAYOUTS.items():
        over: dict[str, list[float]] = {name: [] for name in PLANS}
        for seed in range(chains):
            prof = random_chain(8 + seed % 9, seed, split=True)
            kw: dict[str, Any] = dict(stages=4, devices=devices, chunks=8, schedule=schedule, recompute="never")
            for name, x in over_fastest(prof, kw)[1].items():
                over[name].append(x)
        out.append((schedule, chains, over))
    return out


def chain_table(data: Sequence[tuple[str, int, dict[str, list[float]]]]) -> str:
    lines = ["| schedule | chains | " + " | ".join(f"{name}: slower, worst" for name in PLANS) + " |",
             "|---|---:|" + "---:|" * len(PLANS)]
    for schedule, chains, over in data:
        cells = [f"{sum(x > 1e-7 for x in over[name])}, {max(over[name]):.2f}%" for name in PLANS]
        lines.append(f"| {schedule} | {chains} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def workload_rows(workloads: Sequence[Workload]) -> list[tuple[str, str, int, float, dict[str, float]]]:
    """Per workload and schedule: stages, the fastest step (ms), each plan's % over it."""
    out = []
    for w in workloads:
        for schedule, devices in RANKED.items():
            if len(devices) >= len(w.profile):
                continue  # one layer a stage: a single split
            kw: dict[str, Any] = dict(stages=len(devices), devices=devices, chunks=w.chunks, schedule=schedule,
                                      recompute="never", bandwidth=w.bandwidth)
            truth, over = over_fastest(w.profile, kw)
            out.append((w.name + (" *" if schedule in w.schedules else ""), schedule, len(devices), truth, over))
    return out


def workload_table(data: Sequence[tuple[str, str, int, float, dict[str, float]]]) -> str:
    lines = ["| workload | schedule | stages | fastest ms | " + " | ".join(PLANS) + " |",
             "|---|---|---:|---:|" + "---:|" * len(PLANS)]
    for name, schedule, k, truth, over in data:
        lines.append(f"| {name} | {schedule} | {k} | {truth:.6g} | "
                     + " | ".join(f"{over[p]:.2f}%" for p in PLANS) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=20, help="seeded chains per schedule (default 20)")
    p.add_argument("--workloads", type=int, default=None, help="the first N of torch's workloads (default all)")
    args = p.parse_args(argv)
    cpu = platform.processor() or platform.machine()
    out = [f"python benchmarks/step_split.py {' '.join(argv)}".rstrip(),
           f"{cpu}, {os.cpu_count()} cores, {datetime.date.today().isoformat()} (simulated)"]
    if args.chains > 0:
        out += ["", chain_table(chain_rows(args.chains))]
    workloads = torch_workloads()[:args.workloads]
    if workloads:
        out += ["", workload_table(workload_rows(workloads)),
                "", "* a schedule torch's tests split this workload under"]
    text = "\n".join(out)
    print(text)
    return text


if __name__ == "__main__":
    main()
