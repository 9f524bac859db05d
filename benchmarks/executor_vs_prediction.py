"""Measured executor.GPipe iteration time vs the simulator's prediction for the same plan.

For each bundled example: profile one micro-batch, partition for ``--stages`` CPU stages (one
device, so the simulator serialises them: [Note: shared devices]), build the pipeline, and time
full training iterations (forward + backward over the mini-batch). Also times the same
micro-batches run through the same stage modules by a plain Python loop, which separates the
cost of micro-batching itself from the runtime's scheduling overhead. Prints a markdown table
of medians and ratios (measured / predicted; target within 10%).

    python3 benchmarks/executor_vs_prediction.py --threads 1
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import autopipe
from autopipe.app.train import median_ms
from autopipe.examples import get_example

__all__ = ["Row", "main"]


@dataclass
class Row:
    model: str
    batch: int
    chunks: int
    checkpoint: str
    predicted_ms: float
    measured_ms: float
    loop_ms: float  # the same micro-batches through the same stages, by a plain loop

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.predicted_ms


def measure(name: str, batch: int, chunks: int, checkpoint: str, stages: int,
            repeats: int) -> Row:
    ex = get_example(name, batch_size=batch)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=max(3, repeats // 2))
    plan = autopipe.partition(prof, devices=["cpu"] * stages, chunks=chunks,
                              checkpoint=checkpoint)
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * stages, chunks=chunks,
                             checkpoint=checkpoint, plan=plan)
    pieces = list(zip(*(torch.tensor_split(x, chunks) for x in ex.inputs), strict=True))
    targets = torch.tensor_split(ex.target, chunks)

    def step() -> None:
        ex.loss_fn(pipe(*ex.inputs), ex.target).backward()

    def loop() -> None:
        for inputs, target in zip(pieces, targets, strict=True):
            out: object = inputs
            for stage in pipe.stages:
                out = stage(*out) if isinstance(out, tuple) else stage(out)
            ex.loss_fn(out, target).backward()  # type: ignore[arg-type]

    return Row(name, batch, chunks, checkpoint, plan.iteration_time,
               median_ms(step, repeats, warmup=2), median_ms(loop, repeats, warmup=2))


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "unet"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--checkpoints", nargs="+", default=["never", "except_last"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(m, args.batch, args.chunks, c, args.stages, args.repeats)
            for m in args.models for c in args.checkpoints]
    print("| model | batch | chunks | checkpoint | predicted ms | measured ms | "
          "measured / predicted | plain loop ms | executor / loop |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.model} | {r.batch} | {r.chunks} | {r.checkpoint} | {r.predicted_ms:.2f} | "
              f"{r.measured_ms:.2f} | {r.ratio:.2f} | {r.loop_ms:.2f} | "
              f"{r.measured_ms / r.loop_ms:.2f} |")
    return rows


if __name__ == "__main__":
    main()
