"""The whole job on a bundled example: profile -> partition -> pipeline -> train, in one process.

``autopipe train mlp --stages 2 --chunks 4`` runs this; it is the README's end-to-end command.
It trains on the example's synthetic batch (no data set, no download) with AdamW, and reports
the loss per step, the measured step time against the plan's prediction, and the unpipelined
model's step time measured in the same process (timings here are noisy; the ratio is what
matters).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autopipe.assemble import microbatch_inputs, pipeline
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import AutopipeError
from autopipe.examples import get_example
from autopipe.frontend.graph import trace

__all__ = ["TrainReport", "median_ms", "train_example"]


@dataclass
class TrainReport:
    example: str
    plan: Plan
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    baseline_ms: float = float("nan")
    batch_size: int = 0

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms[1:] or self.step_ms)  # first step warms up

    def summary(self) -> str:
        sps = self.batch_size / (self.median_step_ms / 1e3)
        return "\n".join(
            [
                f"{self.example}: {len(self.plan.stages)} stages x {self.plan.chunks} "
                f"micro-batches, checkpoint={self.plan.checkpoint}, method={self.plan.method}",
                f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f} over {len(self.losses)} steps",
                f"step {self.median_step_ms:.1f} ms (median), {sps:.0f} samples/s; "
                f"predicted {self.plan.iteration_time:.1f} ms "
                f"(measured/predicted {self.median_step_ms / self.plan.iteration_time:.2f}); "
                f"unpipelined {self.baseline_ms:.1f} ms",
            ]
        )


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 0) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls, after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def train_example(
    name: str = "mlp",
    *,
    stages: int = 2,
    chunks: int = 4,
    batch_size: int = 32,
    steps: int = 5,
    checkpoint: str = "except_last",
    devices: Sequence[str] | None = None,
    method: str = "auto",
    plan: Plan | str | None = None,
    profile: Profile | str | None = None,
    lr: float = 1e-3,
    log: Callable[[str], None] | None = print,
) -> TrainReport:
    """Profile, partition and train the bundled example ``name`` as a GPipe pipeline."""
    if steps < 1:
        raise AutopipeError(f"steps={steps} < 1: train at least one step")
    ex = get_example(name, batch_size=batch_size)
    devices = list(devices) if devices is not None else ["cpu"] * stages
    if len(devices) != stages:
        raise AutopipeError(
            f"{len(devices)} devices for {stages} stages: pass one device per stage"
        )
    loaded_plan = Plan.load(plan) if isinstance(plan, str) else plan
    loaded_profile = Profile.load(profile) if isinstance(profile, str) else profile
    graph = trace(ex.model, microbatch_inputs(ex.inputs, chunks))
    pipe = pipeline(ex.model, ex.inputs, devices=devices, chunks=chunks, checkpoint=checkpoint,
                    plan=loaded_plan, profile=loaded_profile, method=method, graph=graph)
    report = TrainReport(name, pipe.plan, batch_size=batch_size)
    if log:
        log(report.plan.table())
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr)
    target = ex.target.to(devices[-1])
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = ex.loss_fn(pipe(*ex.inputs), target)
        loss.backward()
        opt.step()
        report.step_ms.append((time.perf_counter() - start) * 1e3)
        report.losses.append(loss.detach().item())
        if log:
            log(f"step {step + 1}/{steps}  loss {report.losses[-1]:.4f}  "
                f"{report.step_ms[-1]:.1f} ms")

    plain = get_example(name, batch_size=batch_size)

    def plain_step() -> None:
        plain.loss_fn(plain.model(*plain.inputs), plain.target).backward()

    report.baseline_ms = median_ms(plain_step, max(3, steps))
    if log:
        log(report.summary())
    return report
