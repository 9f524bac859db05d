"""Where a split backward's extra time goes, op by op, on one EvenBlocks stage on this host.

    python benchmarks/split_backward_ops.py
    python benchmarks/split_backward_ops.py --rows 256     # M = 4 of batch 1024

One stage of 8 x (Linear(512, 512) + ReLU), one thread: its forward, its whole backward, and its
backward split by executor/ranks/split_backward.py ([Note: split backward on ranks]): the I (input
gradients, with the graph analysis that finds where the weight paths leave the input paths),
then the W (weight gradients from what the I kept). Medians of ``--repeats`` interleaved runs;
then torch.profiler's op table of one W and of one whole backward, whose matrix products show
what the split costs beyond the extra engine runs. Figures, not asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from executor.ranks.split_backward import (
    WeightGrads,
    _node,
    _reverse_edges,
    split_backward,
    weight_groups,
)


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128, help="micro-batch rows (128: batch 1024 in 8)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = nn.Sequential(*[m for _ in range(args.blocks) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    x0, grad = torch.randn(args.rows, args.width), torch.randn(args.rows, args.width)
    weights = WeightGrads(lambda: list(stage.parameters()))

    def forward() -> tuple[Tensor, Tensor]:
        x = x0.detach().requires_grad_(True)
        return x, stage(x)

    def whole() -> None:
        _, y = forward()
        torch.autograd.backward([y], [grad])

    def analysis() -> float:
        x, y = forward()
        start = time.perf_counter()
        roots = [n for n in (_node(y),) if n is not None]  # split_backward's own steps
        reverse, _ = _reverse_edges(roots)
        weight_groups(roots, reverse, [x], stage.parameters())
        return (time.perf_counter() - start) * 1e3

    times: dict[str, list[float]] = {k: [] for k in ("forward", "whole backward", "I", "W", "analysis (in I)")}
    for k in range(args.repeats + 5):
        fwd = _ms(forward)
        both = _ms(whole)
        x, y = forward()
        i_ms = _ms(lambda x=x, y=y: split_backward([y], [grad], [x], weights))
        w_ms = _ms(weights.builder())
        if k >= 5:  # warm-up
            times["forward"].append(fwd)
            times["whole backward"].append(both - fwd)
            times["I"].append(i_ms)
            times["W"].append(w_ms)
            times["analysis (in I)"].append(analysis())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"stage {args.blocks} x Linear({args.width}, {args.width}) + ReLU, {args.rows} rows, torch "
          f"{torch.__version__}, 1 thread, medians of {args.repeats}")
    print("| part | ms |\n|---|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} |")
    split = med["I"] + med["W"]
    print(f"| I + W | {split:.3f} |\n\nsplit / whole backward: {split / med['whole backward']:.2f}x")
    x, y = forward()
    split_backward([y], [grad], [x], weights)
    one_w = weights.builder()
    _, y = forward()
    for name, work in (("one W", one_w), ("one whole backward", lambda: torch.autograd.backward([y], [grad]))):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            work()
        print(f"\n{name}:\n{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=6)}")


if __name__ == "__main__":
    main()
