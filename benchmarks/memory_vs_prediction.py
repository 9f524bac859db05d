"""Predicted vs measured activation memory of every pipeline stage, in bytes.

For each bundled example and recompute mode: profile, partition for ``--stages`` CPU stages,
build the pipeline (executor.GPipe), run one training iteration under
executor.activation_meter.ActivationMeter (the bytes autograd keeps for backward, per stage:
[Note: counting activations]) and compare each stage's peak with the plan's prediction
(``plan.breakdown[s].activation_bytes``, [Note: stage memory] in autopipe/core/stage_memory.py). Bytes
do not depend on the machine's load, so one run is exact; the target is within 10%.

With ``always``, a stage fed a value that its producer also saves ([Note: saved once] in
autopipe/core/layer_costs.py) is predicted one copy of it high per stage: while it recomputes,
the copy it received is both the input it kept and what its first layer saves again, and the
cost model counts it in both ("recompute copy"); "measured / (predicted - recompute copy)" is
what the test holds to 10% there.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import autopipe
from autopipe.core.layer_costs import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.examples import Example, get_example
from executor.activation_meter import ActivationMeter
from executor.host_allocator import use_host_allocator

__all__ = ["Row", "main", "measure_model", "measure_plan", "recompute_copy"]


@dataclass
class Row:
    model: str
    recompute: str
    stage: int
    predicted: int
    measured: int
    recompute_copy: int = 0  # counted twice by the prediction under always (module docstring)

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted else float("nan")

    @property
    def ratio_without_copy(self) -> float:
        total = self.predicted - self.recompute_copy
        return self.measured / total if total else float("nan")


def recompute_copy(prof: Profile, stages: list[list[str]], recompute: str) -> list[int]:
    """Per stage, under ``always``: the received bytes its first layers save again (module
    docstring); 0 otherwise."""
    costs = LayerCosts.from_profile(prof)
    index = {name: i for i, name in enumerate(costs.names)}
    into = costs.cut_bytes(costs.resaved)
    return [int(into[min(index[layer] for layer in layers)]) if recompute == "always" else 0
            for layers in stages]


def measure_model(name: str, batch: int, chunks: int, checkpoints: Sequence[str],
                  stages: int) -> list[Row]:
    """Every recompute mode of one example on one profile of it: a row per stage."""
    ex = get_example(name, batch_size=batch)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=chunks, repeats=1, warmup=0,
                            progress=False)
    devices = ["cpu"] * stages
    return [row for mode in checkpoints for row in measure_plan(
        ex, prof, autopipe.partition(prof, devices=devices, chunks=chunks, recompute=mode))]


def measure_plan(ex: Example, prof: Profile, plan: Plan) -> list[Row]:
    """One training iteration of ``plan`` on one CPU under the meter: a row per stage."""
    mode, chunks = plan.recompute, plan.chunks
    assert isinstance(mode, str), "one recompute mode for every stage"
    pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * len(plan.stages),
                             chunks=chunks, recompute=mode, plan=plan)
    meter = ActivationMeter(pipe.stages, inputs=ex.inputs)
    with meter:
        out = pipe(*ex.inputs)
        with meter.outside():
            loss = ex.loss_fn(out, ex.target)
        loss.backward()
    copies = recompute_copy(prof, plan.stages, mode)
    return [Row(ex.name, mode, s, int(b.activation_bytes), m, c) for s, (b, m, c) in
            enumerate(zip(pipe.plan.breakdown, meter.peaks, copies, strict=True))]


def table(rows: Sequence[Row]) -> str:
    lines = ["| model | checkpoint | stage | predicted bytes | measured bytes | measured / predicted "
             "| recompute copy | measured / (predicted - recompute copy) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.model} | {r.recompute} | {r.stage} | {r.predicted} | {r.measured} | "
              f"{r.ratio:.3f} | {r.recompute_copy} | {r.ratio_without_copy:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
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
