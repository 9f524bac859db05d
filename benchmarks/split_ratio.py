"""What a split backward costs per stage, measured, against what the planner charges.

    python benchmarks/split_ratio.py                  # the two models of distributed_speedup.py
    python benchmarks/split_ratio.py --tiny           # seconds: the tests' configuration

The zero-bubble schedules run each stage's backward as two engine runs, input gradients then
weight gradients (torch.distributed.pipelining's ``stage_backward_input`` and
``stage_backward_weight``). The planner charges a split stage ``bwd_split_ratio`` times its
whole backward ([Note: split backward time] in autopipe/core/cost.py), the ratio the profile
summed over its layers, each measured alone ([Note: split backward measured]). Here each stage
of the 4-stage V plan that benchmarks/distributed_speedup.py runs (``partition(...,
schedule="zbv")`` from a profile of one micro-batch) is built and timed whole, and split, on
its real input, the median of ``--repeats``: "measured" is split / whole, "charged" the
profile's ratio. One thread, no ranks: the ratio of the work alone, not of the runtime's calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import autopipe
from autopipe.assemble.setup import microbatch_inputs
from autopipe.frontend.building.stages import build
from executor._torch_compat import split_backward_api

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from distributed_speedup import _example  # noqa: E402 - after the path it is found on
from precision import environment  # noqa: E402

MODELS = {"uneven": "UnevenMLP", "even": "EvenBlocks"}


@dataclass(frozen=True)
class StageSplit:
    model: str
    stage: int
    layers: int
    whole_ms: float
    split_ms: float
    charged: float  # the profile's bwd_split_ratio

    @property
    def measured(self) -> float:
        return self.split_ms / self.whole_ms


def stage_split(stage: nn.Module, inputs: tuple[Tensor, ...], repeats: int) -> tuple[float, float]:
    """The median ms of ``stage``'s whole backward and of its two halves, on ``inputs``."""
    api = split_backward_api()
    if isinstance(api, str):
        raise SystemExit(f"benchmarks/split_ratio.py: {api}")
    backward_input, backward_weight = api
    weights = [p for p in stage.parameters() if p.requires_grad]

    def forward() -> tuple[list[Tensor], list[Tensor]]:
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = stage(*xs)
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, Tensor)]
        return xs, [t.clone() for t in outs]  # torch detaches the roots in place

    def whole() -> None:
        _, outs = forward()
        start = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        took.append((time.perf_counter() - start) * 1e3)

    def split() -> None:
        xs, outs = forward()
        start = time.perf_counter()
        with warnings.catch_warnings():  # torch sets .grad on the non-leaf inputs
            warnings.simplefilter("ignore")
            _, groups = backward_input(outs, [torch.ones_like(t) for t in outs],
                                       [x for x in xs if x.requires_grad], iter(weights))
        backward_weight(iter(weights), groups)
        took.append((time.perf_counter() - start) * 1e3)

    result = []
    for run in (whole, split):
        took: list[float] = []
        for _ in range(repeats + 1):  # the first warms up
            run()
            stage.zero_grad(set_to_none=True)
        result.append(statistics.median(took[1:]))
    return result[0], result[1]


def measure(model_name: str, batch: int, width: int, chunks: int, repeats: int) -> list[StageSplit]:
    ex = _example(model_name, batch, width)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, progress=False, repeats=repeats, warmup=1)
    plan = autopipe.partition(prof, stages=4, chunks=chunks, recompute="never", schedule="zbv", progress=False)
    micro = microbatch_inputs(ex.inputs, chunks)
    graph = autopipe.trace(ex.model, micro)
    values: tuple[Any, ...] = micro
    rows = []
    for i, stage in enumerate(build(ex.model, plan, graph)):
        whole_ms, split_ms = stage_split(stage, values, repeats)
        rows.append(StageSplit(MODELS[model_name], i, len(plan.stages[i]), whole_ms, split_ms,
                               float(prof.meta.get("bwd_split_ratio") or 1.0)))
        with torch.no_grad():
            out = stage(*values)
        values = out if isinstance(out, tuple) else (out,)
    return rows


def table(rows: Sequence[StageSplit]) -> str:
    lines = ["| model | stage | layers | whole backward ms | split ms | measured split / whole | charged | "
             "charged / measured |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.stage} | {r.layers} | {r.whole_ms:.3f} | {r.split_ms:.3f} | "
                     f"{r.measured:.2f}x | {r.charged:.2f}x | {r.charged / r.measured:.2f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/split_ratio.py", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="uneven,even", help="comma-separated: uneven, even")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--width", type=int, default=512, help="EvenBlocks' width")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches M (the stages run one)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tiny", action="store_true", help="batch 64, width 64, 3 repeats: seconds")
    return p


def main(argv: Sequence[str] | None = None) -> list[StageSplit]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.tiny:
        args.batch, args.width, args.repeats = 64, 64, 3
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        parser().error(f"--models {','.join(unknown)}: choose from {', '.join(MODELS)}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [r for m in args.models.split(",") for r in measure(m, args.batch, args.width, args.chunks,
                                                                     args.repeats)]
    finally:
        torch.set_num_threads(before)
    command = f"python benchmarks/split_ratio.py {' '.join(argv)}".rstrip()
    print(command + "\n" + environment("one thread, medians of " + str(args.repeats)) + "\n\n" + table(rows))
    return rows


if __name__ == "__main__":
    main()
