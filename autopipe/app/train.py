"""The whole job on one model: profile -> partition -> pipeline -> train, in one process.

``autopipe train mlp --stages 2 --chunks 4`` runs this; it is the README's end-to-end command.
It trains a bundled example (or a factory's model, inputs, target and loss) with AdamW, and
reports the loss per step, the measured step against the plan's prediction, and the
unpipelined model's same step (forward, backward, AdamW) measured in the same process.

[Note: one process takes turns] ``executor.GPipe`` runs stages that share a device one at a
time, so on one CPU the pipelined step cannot beat the unpipelined one: it only adds
per-micro-batch overhead and recomputation. The summary says so, predicts the step for the
devices actually used (the simulator's [Note: shared devices]) and for one device per stage,
and names the ``autopipe run`` command that runs each stage in its own process.

With ``precision="bf16"`` / ``"fp16"`` the stages compute under autocast ([Note: mixed
precision] in executor/precision.py), and so do the loss and the unpipelined model's step the
summary compares with; fp16 steps through a ``torch.amp.GradScaler``.

Step ``s`` trains on the model's batch of that step (``LoadedModel.batch``, [Note: a batch per
step] in autopipe/examples.py: a factory without one trains on its one batch every step). With
``checkpoint_dir`` the pipeline and AdamW are saved after the last step (and every
``checkpoint_every``), and ``resume`` trains on from the newest checkpoint there ([Note:
resuming a run] in autopipe/app/run_checkpoints.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from autopipe.app.checkpoint_flags import check_checkpoints
from autopipe.app.config import (
    DEFAULT_BATCH,
    DEFAULT_CHUNKS,
    DEFAULT_STAGES,
    resolve,
)
from autopipe.app.flag_groups import check_clip_grad
from autopipe.app.model_spec import LoadedModel, load_model
from autopipe.app.run_checkpoints import RunCheckpoints, check_before_start, nothing_left
from autopipe.assemble.local import pipeline
from autopipe.assemble.setup import microbatch_inputs, pipeline_precision
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate_stages
from autopipe.errors import AutopipeError, BuildError
from autopipe.frontend.profiling.profiler import profile as profile_model
from autopipe.frontend.tracing.graph import trace
from executor.precision import precision_autocast
from executor.spec import microbatch_sizes

__all__ = ["TrainReport", "median_ms", "train_example"]


@dataclass
class TrainReport:
    example: str
    plan: Plan
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # forward + backward + AdamW
    optimizer_ms: list[float] = field(default_factory=list)  # the AdamW part of each step
    grad_norms: list[float] = field(default_factory=list)  # each step's norm before --clip-grad
    baseline_ms: float = float("nan")  # the unpipelined model's same step
    batch_size: int = 0
    devices: list[str] = field(default_factory=list)
    predicted_ms: float = float("nan")  # forward + backward on these devices
    predicted_apart_ms: float = float("nan")  # forward + backward, one device per stage
    run_command: str = ""
    precision: str = "fp32"

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms[1:] or self.step_ms)  # first step warms up

    @property
    def median_optimizer_ms(self) -> float:
        return statistics.median(self.optimizer_ms[1:] or self.optimizer_ms or [0.0])

    @property
    def median_forward_backward_ms(self) -> float:
        both = [s - o for s, o in zip(self.step_ms, self.optimizer_ms, strict=False)] or self.step_ms
        return statistics.median(both[1:] or both)

    @property
    def shares_devices(self) -> bool:
        return len(set(self.devices)) < len(self.devices)

    def summary(self) -> str:
        k, m = self.plan.num_stages, self.plan.chunks
        micro = microbatch_sizes(self.batch_size, m)[0] if self.batch_size >= m else 0
        step, opt, fb = self.median_step_ms, self.median_optimizer_ms, self.median_forward_backward_ms
        timed = "steps 2.." + str(len(self.step_ms)) if len(self.step_ms) > 1 else "the only step"
        lines = [
            f"{self.example}: batch {self.batch_size} in {m} micro-batches of {micro} rows, "
            f"{k} stages on {', '.join(self.devices)} (recompute={self.plan.recompute}, "
            f"method={self.plan.method}{'' if self.precision == 'fp32' else ', precision=' + self.precision})",
            f"loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f} over {len(self.losses)} steps",
            f"step {step:.1f} ms (medians of {timed}: forward+backward {fb:.1f} ms, AdamW "
            f"{opt:.1f} ms), {self.batch_size / (step / 1e3):.0f} samples/s; predicted forward+backward "
            f"{self.predicted_ms:.1f} ms (measured/predicted {fb / self.predicted_ms:.2f}); "
            f"unpipelined model, same step: {self.baseline_ms:.1f} ms "
            f"(pipelined/unpipelined {step / self.baseline_ms:.2f})",
        ]
        if self.shares_devices:
            lines.append(
                f"Stages on one device take turns: with {k} stages on {self.devices[0]} this process "
                f"runs one micro-batch of one stage at a time, so the pipeline cannot beat the "
                f"unpipelined model here; it adds per-micro-batch overhead and recomputation "
                f"(recompute={self.plan.recompute}), both in the prediction. For a real speedup "
                f"give each stage its own process: `{self.run_command}` "
                f"(predicted forward+backward {self.predicted_apart_ms:.1f} ms with one device per stage)."
            )
        return "\n".join(lines)


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


def _predict(plan: Plan, devices: Sequence[str]) -> float:
    """The plan's simulated GPipe iteration on ``devices`` (shared names take turns)."""
    options = CostOptions(plan.chunks, plan.recompute, plan.optimizer, plan.bandwidth, plan.ties)
    return simulate_stages(plan.breakdown, chunks=plan.chunks, recompute=plan.recompute,
                           ms_per_byte=options.ms_per_byte, devices=list(devices)).iteration_time


def _sizes(plan: Plan | None, profile: Profile | None, stages: int | None, chunks: int | None,
           batch_size: int | None, devices: Sequence[str] | None) -> tuple[int, int, int, list[str]]:
    """Stages, chunks, batch and devices by [Note: one chunks rule] (autopipe/app/config.py)."""
    meta = profile.meta if profile is not None else {}
    k = resolve(stages, plan.num_stages if plan else None, len(devices) if devices else None,
                default=DEFAULT_STAGES)
    if plan is not None and k != plan.num_stages:
        raise BuildError(f"--stages {k} but the plan has {plan.num_stages} stages; drop --stages (it "
                         f"defaults to the plan's) or re-run `autopipe partition --stages {k}`")
    chosen = list(devices) if devices is not None else ["cpu"] * k
    if len(chosen) != k:
        raise AutopipeError(f"{len(chosen)} devices for {k} stages: pass one device per stage "
                            f"(--devices) or --stages {len(chosen)}")
    m = resolve(chunks, plan.chunks if plan else None, meta.get("chunks"), default=DEFAULT_CHUNKS)
    b = resolve(batch_size, plan.batch_size if plan else None, meta.get("batch_size"), default=DEFAULT_BATCH)
    return k, m, b, chosen


def train_example(
    name: str = "mlp",
    *,
    stages: int | None = None,
    chunks: int | None = None,
    batch_size: int | None = None,
    steps: int = 10,
    recompute: str | None = None,
    devices: Sequence[str] | None = None,
    method: str = "auto",
    plan: Plan | str | None = None,
    profile: Profile | str | None = None,
    lr: float = 1e-3,
    clip_grad: float | None = None,
    log: Callable[[str], None] | None = print,
    host_allocator: str = "retain",
    precision: str = "fp32",
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    keep: int | None = None,
) -> TrainReport | None:
    """Profile, partition and train ``name`` (a bundled example or ``package.module:factory``
    returning a target and loss too) as a GPipe pipeline; ``stages``, ``chunks`` and
    ``batch_size`` default to the plan's or profile's, else 2, 4 and 32; ``recompute`` to the
    plan's (one mode per stage), else except_last; ``precision`` is the pipeline's (fp16 with
    a gradient scaler). ``clip_grad``: clip the gradient norm to it before each step
    (``pipe.clip_grad_norm_``, after unscaling), the norms kept in ``report.grad_norms``.
    ``checkpoint_dir`` / ``checkpoint_every`` / ``keep``: save the run there; ``resume``: train
    on from its newest checkpoint to ``steps`` (None, with a line, when it is there already)."""
    if steps < 1:
        raise AutopipeError(f"steps={steps} < 1: train at least one step (--steps 1 or more)")
    check_clip_grad(clip_grad)
    check_checkpoints(checkpoint_dir, checkpoint_every, resume, keep)
    precision = pipeline_precision(precision)
    loaded_plan = Plan.load(plan) if isinstance(plan, str) else plan
    loaded_profile = Profile.load(profile) if isinstance(profile, str) else profile
    k, m, b, chosen = _sizes(loaded_plan, loaded_profile, stages, chunks, batch_size, devices)
    ex = load_model(name, b, for_training="autopipe train")
    resumed = check_before_start(checkpoint_dir, resume, ex.model)  # before profiling
    if resumed is not None and resumed >= steps:
        (log or print)(nothing_left("autopipe train", str(checkpoint_dir), resumed, steps))
        return None
    graph = trace(ex.model, microbatch_inputs(ex.inputs, m))
    if loaded_plan is None and loaded_profile is None:  # with the loss the last stage pays
        loaded_profile = profile_model(ex.model, ex.inputs, chunks=m, device=chosen[0], graph=graph,
                                       host_allocator=host_allocator, loss_fn=ex.loss_fn, target=ex.target,
                                       precision=precision)
    pipe = pipeline(ex.model, ex.inputs, devices=chosen, chunks=m, recompute=recompute,
                    plan=loaded_plan, profile=loaded_profile, method=method, graph=graph,
                    host_allocator=host_allocator, precision=precision)
    run = f"autopipe run {name} --nproc {k} --batch-size {b} --chunks {m}"
    report = TrainReport(ex.name if ":" in name else name, pipe.plan, batch_size=b, devices=chosen,
                         predicted_ms=_predict(pipe.plan, chosen),
                         predicted_apart_ms=_predict(pipe.plan, [f"device{s}" for s in range(k)]),
                         run_command=run + (f" --plan {plan}" if isinstance(plan, str) else "")
                         + ("" if precision == "fp32" else f" --precision {precision}"),
                         precision=precision)
    if log:
        log(report.plan.table())
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr)
    scaler = _scaler(precision, chosen[-1])
    assert ex.loss_fn is not None  # load_model(for_training=...) checked it
    saver = RunCheckpoints.of(checkpoint_dir, checkpoint_every, keep, resume, "autopipe train")
    first = 0
    if saver is not None:
        first, extra, line = saver.load(pipe, opt, steps)
        if extra.get("grad_scaler"):
            scaler.load_state_dict(extra["grad_scaler"])
        if log and line:
            log(line)
    for step in range(first, steps):
        if saver is not None:
            saver.started(step + 1)
        inputs, target = ex.batch(step)  # [Note: a batch per step]
        target = target.to(chosen[-1]) if isinstance(target, torch.Tensor) else target
        start = time.perf_counter()
        opt.zero_grad()
        output = pipe(*inputs)
        with precision_autocast(precision, torch.device(chosen[-1])):  # as the last stage ran
            loss = ex.loss_fn(output, target)
        scaler.scale(loss).backward()
        if clip_grad is not None:
            scaler.unscale_(opt)  # a no-op unless fp16
            report.grad_norms.append(float(pipe.clip_grad_norm_(clip_grad)))
        before_opt = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        done = time.perf_counter()
        report.step_ms.append((done - start) * 1e3)
        report.optimizer_ms.append((done - before_opt) * 1e3)
        report.losses.append(loss.detach().item())
        if log:
            norm = f"grad norm {report.grad_norms[-1]:.4f}  " if clip_grad is not None else ""
            log(f"step {step + 1}/{steps}  loss {report.losses[-1]:.4f}  {norm}"
                f"{report.step_ms[-1]:.1f} ms")
        if saver is not None and saver.due(step + 1, steps):
            folder = saver.save(pipe, opt, step + 1,
                                {"model": name, "batch_size": b, "grad_scaler": scaler.state_dict()})
            if log:
                log(f"saved {folder}")
    report.baseline_ms = _unpipelined_ms(load_model(name, b, for_training="autopipe train"),
                                         chosen[0], lr, max(3, steps), precision)
    if log:
        log(report.summary())
    return report


def _scaler(precision: str, device: str) -> torch.amp.GradScaler:
    """fp16's loss scaling (torch's, in one process); a disabled scaler (a plain step) otherwise."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")


def _unpipelined_ms(plain: LoadedModel, device: str, lr: float, repeats: int,
                    precision: str = "fp32") -> float:
    """The same step (forward, loss, backward, AdamW) on the unpipelined model, on one device,
    under the pipeline's precision."""
    model = plain.model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in plain.inputs)
    target = plain.target.to(device) if isinstance(plain.target, torch.Tensor) else plain.target
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = _scaler(precision, device)
    assert plain.loss_fn is not None
    loss_fn = plain.loss_fn

    def step() -> None:
        opt.zero_grad()
        with precision_autocast(precision, torch.device(device)):
            loss = loss_fn(model(*inputs), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return median_ms(step, repeats, warmup=1)
