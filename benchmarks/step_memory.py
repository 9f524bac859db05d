"""Whole-step peak memory, predicted vs measured as live tensor bytes, in one process and per rank.

    python benchmarks/step_memory.py                 # the tied LM: one process, GPipe and 1F1B on 2 ranks
    python benchmarks/step_memory.py --all           # every configuration of docs/benchmarks.md's table
    python benchmarks/step_memory.py --bind 0.85     # a memory limit that binds, planned and run

A language model is profiled once per precision with its loss (so the profile holds the loss's
bytes: [Note: the loss's memory] in autopipe/core/stage_memory.py, and each layer's backward
working set: [Note: the backward's memory]), planned into 2 stages for each configuration
(:class:`Case`: the model, its runtime, schedule, precision and recomputation), and trained:
one AdamW step to warm up (the optimizer's state appears), then one step measured. The
measured figure is the most live tensor storage at once over that step, forward, loss,
backward and ``optimizer.step()`` (executor.MemoryMeter: [Note: counting live bytes]), what
``torch.cuda.max_memory_allocated`` reports on a GPU; the batch is included and the model's
weights, gradients and optimizer state are tracked from before the step, and on ranks the
receive buffers torch's PipelineStage made at the first step and keeps ([Note: receive buffers]
in autopipe/core/stage_memory.py), which a GPU's allocator counts too. In one process the
step holds the pipeline's output through the backward, as a training loop that keeps
``outputs`` does (the prediction counts it; a loop that drops it peaks lower), and computes
the loss under autocast in bf16, as an AMP loop does and as the profile measured it. The prediction
is the plan's: per rank, ``plan.peak_memory[rank]`` (ZB-V: the rank's two stages,
``plan.device_memory``); in one process, ``plan.device_memory`` (both stages on the one CPU).
The models: ``tied``, TinyGPT whose head is its token embedding (autopipe.examples); ``llama``,
HF LlamaForCausalLM from a config, computing its own loss. ``2x2 fsdp``: 2 stages x 2 replicas
under FSDP2 on 4 ranks, each replica on half the batch. Bytes do not drift with the machine's
load.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.multiprocessing import start_processes

import autopipe
from autopipe.core.plan import Plan
from autopipe.examples import TinyGPT
from autopipe.frontend.profiling.spawned.ports import free_port
from executor.memory_meter import MemoryMeter

__all__ = ["ALL", "Case", "Row", "Size", "main", "measure"]


@dataclass(frozen=True)
class Size:
    vocab: int = 4096
    dim: int = 64
    layers: int = 2
    seq: int = 32
    batch: int = 16
    chunks: int = 4


@dataclass(frozen=True)
class Case:
    """One configuration: ``runtime`` "one process" (executor.GPipe, 2 stages on the one CPU),
    "2 ranks" or "2x2 fsdp" (2 stages x 2 FSDP2 replicas on 4 ranks)."""

    runtime: str = "2 ranks"
    schedule: str = "1f1b"
    model: str = "tied"
    precision: str = "fp32"
    recompute: str = "never"
    even: bool = False  # equal layer counts instead of the planner's split (which follows the timings)
    last: int = 0  # 2 stages, the last of them the model's last ``last`` layers (0: the planner's split)
    alone: tuple[str, ...] = ()  # layers the (even) plan recomputes alone ([Note: recomputed layers])

    @property
    def ranks(self) -> int:
        return {"one process": 0, "2 ranks": 2, "2x2 fsdp": 4}[self.runtime]


# the tied LM's first block from its attention to the next block's first LayerNorm, recomputed
# alone on rank 0 (4 layers or more, equal layer counts): its outputs (the residual stream, saved
# inside, and that LayerNorm's output, saved outside) and their gradients are what torch's
# checkpoint holds beside the saves ([Note: recomputed layers])
SEGMENT = ("scaled_dot_product_attention", "blocks.0.proj", "blocks.0.drop", "add_1", "blocks.0.ln2", "blocks.0.fc1",
           "blocks.0.act", "blocks.0.fc2", "blocks.0.drop#1", "add_2", "blocks.1.ln1")
DEFAULT = (Case("one process", "gpipe"), Case("2 ranks", "gpipe"), Case("2 ranks", "1f1b"))
ALL = (*DEFAULT, Case("2 ranks", "zbv"), Case("2 ranks", "1f1b", recompute="always"),
       Case("one process", "gpipe", precision="bf16"), Case("2 ranks", "1f1b", precision="bf16"),
       Case("2 ranks", "gpipe", model="llama"), Case("2 ranks", "1f1b", model="llama"),
       Case("one process", "gpipe", model="llama"), Case("2x2 fsdp", "1f1b"),
       # a cut that carries the logits (and their view the loss reads): [Note: receive buffers]
       Case("2 ranks", "1f1b", model="llama", last=1), Case("2 ranks", "1f1b", model="llama", last=2))


@dataclass(frozen=True)
class Row:
    case: Case
    where: str  # "process", "rank 0", ...
    measured: int
    predicted: int

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _model(size: Size, model: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The seeded model and its batch, as ``pipeline(**batch)`` / ``profile(...)`` keywords."""
    torch.manual_seed(0)
    x = torch.randint(0, size.vocab, (size.batch, size.seq))
    y = torch.randint(0, size.vocab, (size.batch, size.seq))
    if model == "tied":
        return (TinyGPT(vocab=size.vocab, dim=size.dim, layers=size.layers, max_len=size.seq),
                {"args": (x,), "loss_fn": _lm_loss, "target": y})
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=size.vocab, hidden_size=size.dim, intermediate_size=2 * size.dim,
                                   num_hidden_layers=size.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=size.seq)
    return transformers.LlamaForCausalLM(cfg), {"kwargs": {"input_ids": x, "labels": y}}


def _half(batch: dict[str, Any], replica: int) -> dict[str, Any]:
    """The replica's half of every batch tensor."""
    def cut(v: Any) -> Any:
        return v.tensor_split(2)[replica] if isinstance(v, torch.Tensor) else v
    return {"args": tuple(cut(a) for a in batch.get("args", ())), "loss_fn": batch.get("loss_fn"),
            "target": cut(batch.get("target")), "kwargs": {k: cut(v) for k, v in batch.get("kwargs", {}).items()}}


def _peak(step: Any, track: Sequence[Any] | Callable[[], Sequence[Any]]) -> int:
    step()  # the warm-up step: the optimizer's state appears (and on ranks the receive buffers)
    meter = MemoryMeter(track=track() if callable(track) else track)
    with meter:
        step()
    return meter.peak


def _one_process(size: Size, case: Case, plan: Plan) -> int:
    model, batch = _model(size, case.model)
    args, kwargs = batch.get("args", ()), batch.get("kwargs", {})
    pipe = autopipe.pipeline(model, args, example_kwargs=kwargs or None, devices=["cpu", "cpu"], plan=plan,
                             chunks=plan.chunks, recompute=plan.recompute, precision=case.precision)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def step() -> None:
        out = pipe(*args, **kwargs)  # held through the backward, as a training loop holds its outputs
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16"):  # as an AMP loop
            loss = out.loss if kwargs else _lm_loss(out, batch["target"])
        loss.backward()
        del out
        opt.step()
        opt.zero_grad()

    return _peak(step, (pipe, opt, args, kwargs, batch.get("target")))


def _rank_peak(size: Size, case: Case, plan: Plan) -> int:
    model, batch = _model(size, case.model)
    if case.ranks == 4:
        import torch.distributed as dist

        batch = _half(batch, dist.get_rank() // 2)  # ranks 0, 1: replica 0's stages; 2, 3: replica 1's
    args, kwargs, target = batch.get("args", ()), batch.get("kwargs", {}), batch.get("target")
    pipe = autopipe.distributed_pipeline(model, args, example_kwargs=kwargs or None, loss_fn=batch.get("loss_fn"),
                                         plan=plan, precision=case.precision)
    del model
    params = list(pipe.stage_module.parameters())  # a stage of the loss alone may have none
    opt = torch.optim.AdamW(params, lr=1e-3) if params else None

    def step() -> None:
        if kwargs:
            pipe.step(**kwargs)
        else:
            pipe.step(*args, target=target)
        if opt is not None:
            opt.step()
            opt.zero_grad()

    return _peak(step, lambda: (pipe.stage_module, opt or (), args, kwargs, target, _receive_buffers(pipe)))


def _receive_buffers(pipe: Any) -> list[torch.Tensor]:
    """The receive buffers of a rank's PipelineStages for this step's size ([Note: one schedule
    per input size] in executor/ranks/sized.py), made at its first step."""
    schedule = pipe._schedule
    out = []
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            out += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    return out


def _rank(rank: int, port: int, out: str, world: int, size: Size, work: Sequence[tuple[Case, Plan]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:  # one pipeline after another, each measured alone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save([_rank_peak(size, case, plan) for case, plan in work], Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _ranks(size: Size, world: int, work: Sequence[tuple[Case, Plan]]) -> list[list[int]]:
    """Per (case, plan), each rank's peak: one set of spawned ranks runs them all."""
    if not work:
        return []
    with tempfile.TemporaryDirectory() as out:
        for attempt in range(3):  # a port found free can be taken before rank 0 listens on it
            try:
                start_processes(_rank, args=(free_port(), out, world, size, list(work)), nprocs=world,
                                start_method="spawn")
                break
            except Exception as err:
                if "EADDRINUSE" not in str(err) or attempt == 2:
                    raise
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(world)]
    return [list(peaks) for peaks in zip(*per_rank, strict=True)]


def _profile(size: Size, model: str, precision: str) -> autopipe.Profile:
    module, batch = _model(size, model)
    return autopipe.profile(module, batch.get("args", ()), example_kwargs=batch.get("kwargs") or None,
                            chunks=size.chunks, loss_fn=batch.get("loss_fn"), target=batch.get("target"),
                            repeats=2, precision=precision)


def _plan(prof: autopipe.Profile, size: Size, case: Case, **limits: Any) -> Plan:
    common: dict[str, Any] = dict(chunks=size.chunks, recompute=case.recompute, optimizer="adamw",
                                  schedule=case.schedule)
    if case.runtime == "one process" and not case.even:
        return autopipe.partition(prof, stages=2, runtime="gpipe", devices=["cpu", "cpu"], **common, **limits)
    if case.runtime == "2x2 fsdp":
        return autopipe.partition(prof, devices=4, data_parallel=2, dp_mode="fsdp", runtime="distributed",
                                  bandwidth=None, batch_size=size.batch, **common, **limits)
    devices = ["rank0", "rank1", "rank1", "rank0"] if case.schedule == "zbv" else None
    if case.last:
        names = list(prof.layers)
        return Plan.from_stages(prof, [names[:-case.last], names[-case.last:]], bandwidth=None,
                                runtime="gpipe" if case.ranks == 0 else "distributed", **common)
    if case.even:
        parts = [list(p) for p in np.array_split(np.array(prof.layers), 4 if devices else 2)]
        return Plan.from_stages(prof, parts, devices=devices or (["cpu", "cpu"] if case.ranks == 0 else None),
                                bandwidth=None, runtime="gpipe" if case.ranks == 0 else "distributed",
                                recompute_layers=case.alone, **common)
    return autopipe.partition(prof, stages=4 if devices else 2, devices=devices, runtime="distributed",
                              bandwidth=None, **common, **limits)


def _predicted(plan: Plan, case: Case, where: int) -> int:
    if case.runtime == "one process":
        return sum(plan.device_memory.values())
    if case.schedule == "zbv":  # a rank holds two stages
        return plan.device_memory[f"rank{where}"]
    return plan.peak_memory[where % 2]  # under replicas, rank r holds stage r mod 2


def measure(size: Size, cases: Sequence[Case] = DEFAULT) -> list[Row]:
    """Each case's rows, in order: one process, then each rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unmeasured distributed call cost: not a memory matter
        profiles = {(c.model, c.precision): _profile(size, c.model, c.precision) for c in cases}
        plans = [_plan(profiles[c.model, c.precision], size, c) for c in cases]
        peaks: dict[int, list[int]] = {}
        for world in sorted({c.ranks for c in cases} - {0}):
            mine = [i for i, c in enumerate(cases) if c.ranks == world]
            peaks.update(zip(mine, _ranks(size, world, [(cases[i], plans[i]) for i in mine]), strict=True))
        rows = []
        for i, (case, plan) in enumerate(zip(cases, plans, strict=True)):
            if case.ranks == 0:
                rows.append(Row(case, "process", _one_process(size, case, plan), _predicted(plan, case, 0)))
            else:
                rows += [Row(case, f"rank {r}", peak, _predicted(plan, case, r)) for r, peak in enumerate(peaks[i])]
    return rows


def _modes(plan: Plan) -> str:
    """Each stage's recompute mode, and how many layers recompute alone ([Note: recomputed
    layers])."""
    alone = f" + {len(plan.recompute_layers)} layers alone" if plan.recompute_layers else ""
    return "/".join(plan.stage_recompute) + alone


def binding(size: Size, case: Case = Case(), fraction: float = 0.85) -> tuple[int, list[Row]]:
    """A memory limit that binds: ``fraction`` of the largest rank peak the plan without one
    predicts; that plan and the one made under the limit (recompute="auto") run on 2 ranks.
    Returns the limit and the rows (the cases' ``recompute`` says which plan)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = _profile(size, case.model, case.precision)
        free = _plan(prof, size, case)
        limit = int(max(free.peak_memory) * fraction)
        bound = _plan(prof, size, replace(case, recompute="auto"), memory_limit=limit)
        work = [(replace(case, recompute=f"no limit: {_modes(free)}"), free),
                (replace(case, recompute=f"under the limit: {_modes(bound)}"), bound)]
        rows = []
        for (c, plan), peaks in zip(work, _ranks(size, 2, work), strict=True):
            rows += [Row(c, f"rank {r}", peak, plan.peak_memory[r]) for r, peak in enumerate(peaks)]
    return limit, rows


def table(rows: Sequence[Row]) -> str:
    lines = ["| runtime | schedule | model | precision | recompute | where | peak MiB measured | "
             "peak MiB predicted | measured / predicted |", "|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        c = r.case
        split = f", last {c.last} layer{'s' if c.last > 1 else ''}" if c.last else ""
        alone = f" + {len(c.alone)} layers alone" if c.alone else ""
        lines.append(f"| {c.runtime}{split} | {c.schedule} | {c.model} | {c.precision} | {c.recompute}{alone} | {r.where} | "
                     f"{r.measured / 2**20:.2f} | {r.predicted / 2**20:.2f} | {r.ratio:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--vocab", type=int, default=Size.vocab)
    parser.add_argument("--batch", type=int, default=Size.batch)
    parser.add_argument("--dim", type=int, default=Size.dim)
    parser.add_argument("--layers", type=int, default=Size.layers)
    parser.add_argument("--seq", type=int, default=Size.seq)
    parser.add_argument("--all", action="store_true", help="every configuration (the ALL cases), not the default three")
    parser.add_argument("--bind", type=float, metavar="FRACTION",
                        help="plan 1F1B under this fraction of the unlimited plan's largest rank peak "
                             "and run both plans on 2 ranks")
    parser.add_argument("--alone", action="store_true",
                        help="only 1F1B on 2 ranks, equal layer counts, rank 0 recomputing SEGMENT alone "
                             "(with --layers 4 or more)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = Size(vocab=args.vocab, dim=args.dim, layers=args.layers, seq=args.seq, batch=args.batch)
    if args.bind is not None:
        limit, rows = binding(size, fraction=args.bind)
        print(f"memory limit {limit / 2**20:.2f} MiB; measured over it: "
              f"{', '.join(f'{r.case.recompute} {r.where}' for r in rows if r.measured > limit) or 'none'}")
    elif args.alone:
        rows = measure(size, [Case("2 ranks", "1f1b", even=True, alone=SEGMENT)])
    else:
        rows = measure(size, ALL if args.all else DEFAULT)
    print(f"vocab {size.vocab}, dim {size.dim}, {size.layers} layers, seq {size.seq}, batch {size.batch} in "
          f"{size.chunks} micro-batches, 2 stages, AdamW; torch {torch.__version__}")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
