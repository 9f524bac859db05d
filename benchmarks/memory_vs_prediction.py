"""Predicted vs measured activation memory of every pipeline stage, in bytes, for every cut.

For each bundled example: profile it once, then for every place to cut it into two CPU stages
(``--every N``: every Nth) and every recompute mode, build the pipeline (executor.GPipe), run
one training iteration under executor.activation_meter.ActivationMeter (the bytes autograd keeps
for backward, per stage: [Note: counting activations]) and compare each stage's peak with the
plan's prediction (``plan.breakdown[s].activation_bytes``, [Note: stage memory] in
autopipe/core/stage_memory.py). Bytes do not depend on the machine's load, and every cut is
tried, not the one a timed profile happens to favour, so one run is exact and the same on every
machine. The prediction is exact (tests/test_benchmark_memory_vs_prediction.py holds it to the
byte), but for one known double count:

under ``always``, while a micro-batch recomputes, the stage's received input is both the input it
kept and what its layers save again: one tensor. The prediction holds what its FIRST layer saves
of it once ([Note: an input kept once] in autopipe/core/stage_memory.py); what later layers save
of a received value (a skip) it still counts twice. The meter counts how much of its own input
each stage's layers save (``input_saves``): "kept twice" is that, less what the prediction holds
once; "measured / (predicted - kept twice)" is what the test holds to 1, and "measured /
predicted" shows what the double count costs (safe side).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

import autopipe
from autopipe.core.plan import Plan
from autopipe.examples import Example, get_example
from autopipe.frontend.tracing.graph import LayerGraph
from executor.activation_meter import ActivationMeter
from executor.host_allocator import use_host_allocator

__all__ = ["Row", "main", "measure_model", "measure_plan"]


@dataclass
class Row:
    model: str
    recompute: str
    cut: str  # the first layer of stage 1
    stage: int
    predicted: int
    measured: int
    kept_twice: int = 0  # counted twice by the prediction under always (module docstring)

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float(self.measured == 0)

    @property
    def ratio_without_copy(self) -> float:
        total = self.predicted - self.kept_twice
        return self.measured / total if total else float(self.measured == 0)


def measure_model(name: str, batch: int, chunks: int, modes: Sequence[str], every: int = 1) -> list[Row]:
    """Every ``every``-th two-stage cut of one example, in every mode, on one profile of it."""
    ex = get_example(name, batch_size=batch)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=1, warmup=0, progress=False)
    graph = autopipe.trace(ex.model, tuple(t[: batch // chunks] for t in ex.inputs))
    layers = prof.layers
    return [row for k in range(1, len(layers), every) for mode in modes
            for row in measure_plan(ex, Plan.from_stages(prof, [layers[:k], layers[k:]], devices=["cpu", "cpu"],
                                                         chunks=chunks, recompute=mode), graph)]


def measure_plan(ex: Example, plan: Plan, graph: LayerGraph | None = None) -> list[Row]:
    """One training iteration of ``plan`` on one CPU under the meter: a row per stage."""
    mode, chunks = plan.recompute, plan.chunks
    assert isinstance(mode, str), "one recompute mode for every stage"
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * len(plan.stages),
                             chunks=chunks, recompute=mode, plan=plan, graph=graph)
    meter = ActivationMeter(pipe.stages, inputs=ex.inputs)
    with meter:
        out = pipe(*ex.inputs)
        with meter.outside():
            loss = ex.loss_fn(out, ex.target)
        loss.backward()
    # what the stage's layers save of its input beyond what the prediction holds once (its first
    # layer's: [Note: an input kept once])
    twice = [max(m - b.input_saved_bytes, 0) if mode == "always" else 0
             for m, b in zip(meter.input_saves, pipe.plan.breakdown, strict=True)]
    return [Row(ex.name, mode, plan.stages[1][0] if len(plan.stages) > 1 else "", s,
                int(b.activation_bytes), m, c)
            for s, (b, m, c) in enumerate(zip(pipe.plan.breakdown, meter.peaks, twice, strict=True))]


def table(rows: Sequence[Row]) -> str:
    """Per model and mode: the cuts tried and the range of both ratios over every stage."""
    lines = ["| model | recompute | cuts | measured / predicted | measured / (predicted - kept twice) |",
             "|---|---|---:|---:|---:|"]
    for (model, mode), group in _groups(rows):
        plain = [r.ratio for r in group]
        fair = [r.ratio_without_copy for r in group]
        lines.append(f"| {model} | {mode} | {len({r.cut for r in group})} | "
                     f"{min(plain):.3f}-{max(plain):.3f} | {min(fair):.3f}-{max(fair):.3f} |")
    return "\n".join(lines)


def _groups(rows: Sequence[Row]) -> Iterator[tuple[tuple[str, str], list[Row]]]:
    keys = dict.fromkeys((r.model, r.recompute) for r in rows)
    for key in keys:
        yield key, [r for r in rows if (r.model, r.recompute) == key]


def main(argv: Sequence[str] | None = None) -> list[Row]:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt", "unet"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--every", type=int, default=1, help="try every Nth cut (default: all)")
    parser.add_argument("--checkpoints", nargs="+", default=["never", "except_last", "always"])
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [r for m in args.models
                for r in measure_model(m, args.batch, args.chunks, args.checkpoints, args.every)]
    finally:
        torch.set_num_threads(threads)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
