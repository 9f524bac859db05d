"""Predicted vs measured activation memory of every pipeline stage, in bytes.

For each bundled example and checkpoint mode: profile, partition for ``--stages`` CPU stages,
build the pipeline (executor.GPipe), run one training iteration under
executor.activation_meter.ActivationMeter (the bytes autograd keeps for backward, per stage:
[Note: counting activations]) and compare each stage's peak with the plan's prediction
(``plan.breakdown[s].activation_bytes``, [Note: stage memory] in autopipe/core/cost.py). Bytes
do not depend on the machine's load, so one run is exact; the target is within 10%.

The prediction follows torch.distributed.pipelining's GPipe order (backward of micro-batch 0
first); executor.GPipe drains in reverse and recomputes the mirror-image micro-batches, with
the same peak ([Note: which micro-batches recompute] in executor/spec.py).

    python3 benchmarks/memory_vs_prediction.py
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import autopipe
from autopipe.examples import get_example
from executor.activation_meter import ActivationMeter

__all__ = ["Row", "main", "measure_model"]


@dataclass
class Row:
    model: str
    checkpoint: str
    stage: int
    predicted: int
    measured: int

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")


def measure_model(name: str, batch: int, chunks: int, checkpoints: Sequence[str],
                  stages: int) -> list[Row]:
    """Every checkpoint mode of one example on one profile of it: a row per stage."""
    ex = get_example(name, batch_size=batch)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=1, warmup=0,
                            progress=False)
    devices = ["cpu"] * stages
    rows = []
    for mode in checkpoints:
        plan = autopipe.partition(prof, devices=devices, chunks=chunks, checkpoint=mode)
        pipe = autopipe.pipeline(ex.model, ex.inputs, devices=devices, chunks=chunks,
                                 checkpoint=mode, plan=plan)
        meter = ActivationMeter(pipe.stages, inputs=ex.inputs)
        with meter:
            out = pipe(*ex.inputs)
            with meter.outside():
                loss = ex.loss_fn(out, ex.target)
            loss.backward()
        rows += [Row(name, mode, s, int(b.activation_bytes), m)
                 for s, (b, m) in enumerate(zip(pipe.plan.breakdown, meter.peaks, strict=True))]
    return rows


def table(rows: Sequence[Row]) -> str:
    lines = ["| model | checkpoint | stage | predicted bytes | measured bytes | measured / predicted |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r.model} | {r.checkpoint} | {r.stage} | {r.predicted} | {r.measured} | "
              f"{r.ratio:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "unet"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--checkpoints", nargs="+", default=["never", "except_last", "always"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for m in args.models
            for r in measure_model(m, args.batch, args.chunks, args.checkpoints, args.stages)]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
