"""The automatic plan against hand-set ones where memory binds (simulated iterations).

    python benchmarks/auto_plan.py                      # 200-layer DAG + TinyLlama-1.1B's shape
    python benchmarks/auto_plan.py --no-llama           # the synthetic DAG only (no torch)
    python benchmarks/auto_plan.py --llama-profile profiles/llama1b   # profile once, reuse

For each profile and memory limit, ``partition(stages="auto", chunks="auto", recompute="auto",
schedule="auto")`` on D devices, and the same with ``chunks`` fixed at the profile's (a
"fixed M" row: with one measured micro-batch size the model charges nothing for more, smaller
micro-batches, so chunks="auto" takes many and memory rarely binds; at a fixed M it does), is
compared with two plans a user might set by hand, all simulated by autopipe.core.simulator:

- recompute everywhere, uniform stages: D stages of equal layer counts, ``recompute="always"``,
  the profile's micro-batches, GPipe (the safe torchgpipe-style default);
- the best single-mode plan of the same K, M and schedule as the auto plan: the DP split with
  one recompute mode for every stage (the fastest of the modes that fit).

Memory limits are fractions of what the fastest never-recompute GPipe split at the profile's
micro-batches needs on its fullest device, so they bind. The Llama-1B-class profile is measured
layer by layer on a model built on the meta device (``autopipe.profile(..., mode="layers")``),
which needs torch and transformers; the DAG is autopipe.solvers.synthetic's.

    python benchmarks/auto_plan.py --measured           # bundled examples, run and timed on CPU
    python benchmarks/auto_plan.py --measured --examples gpt --steps 20

``--measured`` runs plans instead of simulating them: for each bundled example
(autopipe.examples) a profile measured here (1 thread, at several micro-batch sizes so that
``chunks="auto"`` sees the cost of a micro-batch), 2 devices of a memory limit that binds (a
``--fraction`` of the way from what the GPipe recipe needs on its fullest device to the least
that any split never recomputing at M = 8 needs), and three plans:

- auto: ``partition(stages="auto", chunks="auto", recompute="auto", schedule="auto")``, among
  the schedules the runtimes run (the zero-bubble ones are left out until the distributed
  runtime runs them);
- the GPipe paper's recipe: K = 2 devices, M = 4K = 8, recompute everywhere, equal layer counts;
- the best single-mode plan of the auto plan's K, M and schedule.

Each runs on two runtimes. One process (``autopipe.pipeline(..., devices=["cpu"] * K)``,
executor.GPipe, 1 thread): it runs only gpipe, so there the auto plan is searched with
``schedule="gpipe"``; its stages share one CPU and take turns, so besides the plan's own
prediction (2 devices) the table gives ``pipe.plan``'s, re-simulated for one shared device.
Two gloo ranks x 1 thread (``distributed_pipeline(..., plan=)``, the plan's schedule): the
devices the plan was made for, when the machine has two idle cores. Its plans are made from the
same profile plus what ``autopipe profile --comm`` measures once per run (the transfer between
two ranks and the distributed runtime's call cost under each schedule: [Note: measured
transfer]), as a user planning for ranks would; there the auto plan
searched with ``schedule="gpipe"`` runs too ("auto, gpipe") when the search chose another
schedule. The plans of a runtime are built first and then take turns step by step, so a change
in the machine's load hits them alike. Times are the median, min and max of ``--steps`` steps
after ``--warmup`` (on 2 ranks, per step the slower rank's; each step starts after a barrier).
The memory limit binds in the planner only: on CPU nothing enforces it, and peak memory is
not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.profile_table import SPLIT_COLUMNS, Profile
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError
from autopipe.frontend.profiling.spawned.ports import free_port
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import transformer_dag
from executor.host_allocator import use_host_allocator
from executor.ranks.rank_cores import pin_local_rank
from executor.spec import RECOMPUTE_MODES

__all__ = ["main", "Row", "Plans", "Timed", "measured_plans", "measured_profile", "measure"]


@dataclass
class Row:
    profile: str
    chunks: str  # "auto" or the fixed M
    limit: int
    auto: Plan
    seconds: float
    uniform: Plan
    single: Plan | None


def dag_profile(blocks: int, batch: int, chunks: int) -> Profile:
    prof = transformer_dag(blocks, hidden_bytes=4 << 20)
    prof.meta.update(micro_batch_size=-(-batch // chunks), batch_size=batch, chunks=chunks)
    return prof


def add_llama_arguments(parser: argparse.ArgumentParser, *, seq: int = 256, batch: int = 32) -> None:
    """The meta-built HF Llama's shape (TinyLlama-1.1B's) and how it is profiled: the flags
    :func:`llama_config` and :func:`llama_profile` read (benchmarks/ppdp.py and giant.py too)."""
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=batch, help="the Llama profile's batch")
    parser.add_argument("--chunks", type=int, default=8, help="the Llama profile's micro-batches")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)


def llama_config(args: argparse.Namespace) -> Any:
    """The ``transformers.LlamaConfig`` of :func:`add_llama_arguments`' flags."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128))


def llama_profile(args: argparse.Namespace) -> Profile:
    """A HF Llama built on meta, profiled layer by layer (saved to / read from --llama-profile)."""
    path = Path(args.llama_profile) if args.llama_profile else None
    if path is not None and path.with_suffix(".csv").exists():
        return Profile.load(path)
    import torch
    import transformers

    import autopipe

    torch.set_num_threads(args.threads)
    config = llama_config(args)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    prof = autopipe.profile(model, (ids,), chunks=args.chunks, mode="layers", repeats=args.repeats,
                            warmup=1, progress=False)
    if path is not None:
        prof.save(path)
    return prof


def compare(name: str, prof: Profile, devices: int, fractions: Sequence[float]) -> list[Row]:
    pool = [f"gpu:{i}" for i in range(devices)]
    chunks = int(prof.meta["chunks"])
    free = partition(prof, devices=pool, chunks=chunks, recompute="never", method="dp", progress=False)
    rows = []
    for fraction in fractions:
        limit = int(max(free.stage_memory) * fraction)
        limit = limit >> 20 << 20 if limit >= 1 << 24 else limit  # whole MiB for real sizes
        for chosen in ("auto", chunks):
            start = time.perf_counter()
            try:
                auto = partition(prof, devices=pool, memory_limit=limit, stages="auto", chunks=chosen,
                                 batch_size=int(prof.meta["batch_size"]), recompute="auto",
                                 schedule="auto", progress=False)
            except AutopipeError as err:
                print(f"{name} at {format_bytes(limit)}, chunks {chosen}: {err}")
                continue
            seconds = time.perf_counter() - start
            uniform = partition(prof, devices=pool, chunks=chunks, recompute="always", method="uniform",
                                memory_limit=limit, progress=False)
            rows.append(Row(name, str(chosen), limit, auto, seconds, uniform, _single(prof, auto)))
    return rows


def _single(prof: Profile, auto: Plan) -> Plan | None:
    """The fastest plan with one recompute mode for every stage, at the auto plan's K, M and
    schedule, on its devices."""
    best = None
    for mode in RECOMPUTE_MODES:
        try:
            plan = partition(prof, devices=auto.devices, chunks=auto.chunks, batch_size=auto.batch_size,
                             recompute=mode, schedule=auto.schedule, method="dp", progress=False)
        except AutopipeError:
            continue  # this mode does not fit at that K and M
        if best is None or plan.iteration_time < best.iteration_time:
            best = plan
    return best


def _peak(plan: Plan) -> int:
    """What a plan needs of each device's memory: its fullest device's simulated peak, or a
    stage's modelled peak where that is higher (what partition's memory limit checks)."""
    return max([*plan.device_memory.values(), *plan.stage_memory])


def _fits(plan: Plan, limit: int) -> bool:
    return _peak(plan) <= limit


def table(rows: Sequence[Row]) -> str:
    lines = ["| profile | memory limit | chunks | auto: stages, chunks, schedule, recomputation | "
             "auto ms | search s | all recompute, uniform ms | speedup | best single mode, same K "
             "and M | speedup |",
             "|---|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        a = r.auto
        uni = f"{r.uniform.iteration_time:.1f}" + ("" if _fits(r.uniform, r.limit) else " (over the limit)")
        single = (f"{r.single.recompute}: {r.single.iteration_time:.1f} ms" if r.single else "none fits")
        ratio = f"{r.single.iteration_time / a.iteration_time:.2f}x" if r.single else ""
        lines.append(
            f"| {r.profile} | {format_bytes(r.limit)} | {r.chunks} | {a.num_stages}, {a.chunks} of "
            f"{a.micro_batch_size} rows, {a.schedule}, {_modes(a)} | {a.iteration_time:.1f} | "
            f"{r.seconds:.2f} | {uni} | {r.uniform.iteration_time / a.iteration_time:.2f}x | "
            f"{single} | {ratio} |")
    return "\n".join(lines)


# --- measured: bundled examples run on CPU, one process and 2 gloo ranks ----------------------
MEASURED_BATCH = {"mlp": 1024, "gpt": 32, "cnn": 64, "unet": 32}
RECIPE_DEVICES = 2  # the GPipe paper's recipe: K = devices, M = 4K, always, uniform


@dataclass
class Plans:
    """One example's plans (``auto_gpipe`` is ``auto`` when the search chose gpipe anyway)."""

    example: str
    batch: int
    limit: int
    auto: Plan
    auto_gpipe: Plan
    recipe: Plan
    single: Plan | None  # best single mode at auto's K, M and schedule
    single_gpipe: Plan | None
    binds: bool  # never recomputing at M = 8 needs more than the recipe: the limit lies between
    recompute_ratio: float  # the profile's recompute / forward ([Note: measured overheads])

    @property
    def label(self) -> str:
        label = f"{self.example}, B={self.batch}, r={self.recompute_ratio:.2f}"
        return label if self.binds else label + " (never at M=8 fits in the recipe's memory)"


@dataclass
class Timed:
    """One plan run on one runtime: predicted (plan's devices, and as run) and measured ms."""

    example: str  # Plans.label
    limit: int
    runtime: str  # "1 process" or "2 ranks"
    name: str  # "auto", "recipe", "single"
    plan: Plan
    as_run_ms: float
    times: list[float]  # per step, ms; empty when not run
    note: str = ""


def measured_profile(example: str, batch: int, repeats: int) -> Profile:
    """The example profiled here, one thread, at M = 8 and at every power-of-two micro-batch,
    with its loss ([Note: the loss in the last stage]), as `autopipe profile` measures it."""
    import torch

    from autopipe.examples import get_example
    from autopipe.frontend.profiling.profiler import profile

    torch.set_num_threads(1)
    ex = get_example(example, batch_size=batch)
    sizes = [1 << i for i in range(batch.bit_length()) if 1 << i <= batch]
    prof = profile(ex.model, ex.inputs, chunks=4 * RECIPE_DEVICES, repeats=repeats, warmup=1,
                   micro_batch_sizes=sizes, progress=False, loss_fn=ex.loss_fn, target=ex.target)
    return prof


def rank_profile(example: str, prof: Profile, comm: dict[str, Any]) -> Profile:
    """``prof`` as `autopipe profile --comm` leaves it for ranks on this host: the measured
    transfer and call costs, and how much slower the example computes beside a copy of itself
    ([Note: ranks sharing a host])."""
    from autopipe.examples import get_example
    from autopipe.frontend.profiling.spawned.comm import with_comm

    ex = get_example(example, batch_size=int(prof.meta["batch_size"]))
    # the ranks' slowdown measured here, the transfer and call costs once for every example
    return with_comm(prof, model=ex.model, example_inputs=ex.inputs, measured=comm)


def measured_plans(example: str, prof: Profile, fraction: float) -> Plans:
    """The auto plan, the GPipe recipe and the best single mode under a limit that binds."""
    batch = int(prof.meta["batch_size"])
    pool = [f"cpu:{i}" for i in range(RECIPE_DEVICES)]
    m = 4 * RECIPE_DEVICES
    recipe = partition(prof, devices=pool, chunks=m, batch_size=batch, recompute="always",
                       method="uniform", progress=False)
    low, high = _peak(recipe), never_needs(prof, pool, m)
    limit = int(low + fraction * (high - low)) if high > low else low
    recipe = partition(prof, devices=pool, chunks=m, batch_size=batch, recompute="always",
                       method="uniform", memory_limit=limit, progress=False)

    # what the runtime runs: without the split backward the search leaves the zero-bubble
    # schedules out, which the distributed runtime does not run yet
    runnable = dataclasses.replace(prof, df=prof.df.drop(columns=list(SPLIT_COLUMNS), errors="ignore"))

    def auto(schedule: str) -> Plan:
        return partition(runnable, devices=pool, memory_limit=limit, stages="auto", chunks="auto",
                         batch_size=batch, recompute="auto", schedule=schedule, progress=False)

    best = auto("auto")
    gpipe = best if best.schedule == "gpipe" else auto("gpipe")
    single = _single(prof, best)
    return Plans(example, batch, limit, best, gpipe, recipe, single,
                 single if gpipe is best else _single(prof, gpipe), high > low,
                 prof.corrections.recompute_ratio)


def never_needs(prof: Profile, pool: Sequence[str], chunks: int) -> int:
    """The least memory per device (bytes, within 0.1%) at which some split never recomputing
    at ``chunks`` micro-batches fits (bisection: the DP finds a split whenever one fits)."""
    batch = int(prof.meta["batch_size"])

    def fits(limit: int) -> bool:
        try:
            partition(prof, devices=pool, chunks=chunks, batch_size=batch, recompute="never",
                      method="dp", memory_limit=limit, progress=False)
        except AutopipeError:
            return False
        return True

    high = _peak(partition(prof, devices=pool, chunks=chunks, batch_size=batch, recompute="never",
                           method="dp", progress=False))
    low = 0
    while high - low > max(1, high // 1000):
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _key(plan: Plan) -> tuple[object, ...]:
    return (str(plan.stages), plan.chunks, str(plan.recompute), plan.schedule)


def _steps(runs: Sequence[Callable[[], object]], steps: int, warmup: int,
           before: Callable[[], object] | None = None) -> list[list[float]]:
    """Step times (ms) of each of ``runs``, taking turns step by step, so that a change in the
    machine's load between them hits them all alike; ``before`` runs untimed before each."""
    times: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + steps):
        for run, out in zip(runs, times, strict=True):
            if before is not None:
                before()
            t0 = time.perf_counter()
            run()
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
    return times


def one_process(example: str, batch: int, plans: Sequence[Plan], steps: int,
                warmup: int) -> list[tuple[float, list[float]]]:
    """Each plan run by autopipe.pipeline with every stage on the one CPU: the prediction for
    that placement (pipe.plan) and the step times."""
    import warnings

    import torch

    import autopipe
    from autopipe.examples import get_example

    torch.set_num_threads(1)
    runs, predicted = [], []
    for plan in plans:
        ex = get_example(example, batch_size=batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the placement warning this table shows
            pipe = autopipe.pipeline(ex.model, ex.inputs, devices=["cpu"] * plan.num_stages,
                                     chunks=plan.chunks, plan=plan)
        predicted.append(pipe.plan.iteration_time)
        runs.append(functools.partial(_loss_backward, pipe, ex.inputs, ex.target, ex.loss_fn))
    return list(zip(predicted, _steps(runs, steps, warmup), strict=True))


def _loss_backward(pipe: Callable[..., Any], inputs: tuple[Any, ...], target: Any,
                   loss_fn: Callable[[Any, Any], Any]) -> None:
    loss_fn(pipe(*inputs), target).backward()


def _rank_steps(rank: int, example: str, batch: int, plans: list[dict[str, object]], steps: int,
                warmup: int) -> list[list[float]]:
    import torch.distributed as dist

    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.examples import get_example

    runs = []
    for data in plans:
        plan = Plan.from_dict(data)
        ex = get_example(example, batch_size=batch)
        pipe = distributed_pipeline(ex.model, ex.inputs, loss_fn=ex.loss_fn, plan=plan,
                                    chunks=plan.chunks, schedule=plan.schedule, host_allocator="retain")
        runs.append(functools.partial(pipe.step, *ex.inputs, target=ex.target))
    return _steps(runs, steps, warmup, before=dist.barrier)  # each step starts on both ranks at once


def _rank_entry(rank: int, port: int, out: str, args: tuple[object, ...]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    pin_local_rank(rank, 2)  # as `autopipe run` places its ranks
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    times = _rank_steps(rank, *args)  # type: ignore[arg-type]
    dist.barrier()
    torch.save(times, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def two_ranks(example: str, batch: int, plans: Sequence[Plan], steps: int, warmup: int) -> list[list[float]]:
    """Each plan run on 2 gloo ranks x 1 thread (one process group for them all): per step, the
    slower rank's time."""
    import sys
    import tempfile

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
    from forked_ranks import start_ranks

    port = free_port()  # [Note: a rendezvous port]
    args = (example, batch, [p.to_dict() for p in plans], steps, warmup)
    with tempfile.TemporaryDirectory() as out:
        start_ranks(_rank_entry, (port, out, args), 2)
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(2)]
    return [[max(a, b) for a, b in zip(x, y, strict=True)] for x, y in zip(*per_rank, strict=True)]


def measure(plans: Plans, steps: int, warmup: int, ranks: bool = True,
            rank_plans: Plans | None = None) -> list[Timed]:
    """Every plan of ``plans`` on one process and (``ranks``) those of ``rank_plans`` (default:
    ``plans``) on 2 ranks, where the auto plan searched for gpipe runs too when it differs; a
    plan equal to another is run once."""
    rows: list[Timed] = []
    ex, b, lim = plans.example, plans.batch, plans.limit
    named = [(n, p) for n, p in (("auto", plans.auto_gpipe), ("recipe", plans.recipe),
                                 ("single", plans.single_gpipe)) if p is not None]
    unique = list({_key(p): p for _, p in named}.values())
    done = dict(zip([_key(p) for p in unique], one_process(ex, b, unique, steps, warmup), strict=True))
    for name, plan in named:
        note = "= auto" if name == "single" and _key(plan) == _key(plans.auto_gpipe) else ""
        rows.append(Timed(plans.label, lim, "1 process", name, plan, *done[_key(plan)], note=note))
    if not ranks:
        return rows
    plans = rank_plans or plans
    named = [(n, p) for n, p in (("auto", plans.auto), ("recipe", plans.recipe), ("single", plans.single),
                                 ("auto, gpipe", plans.auto_gpipe if plans.auto_gpipe is not plans.auto else None))
             if p is not None]
    unique = list({_key(p): p for _, p in named if p.num_stages % 2 == 0}.values())
    times = dict(zip([_key(p) for p in unique], two_ranks(ex, b, unique, steps, warmup), strict=True))
    for name, plan in named:
        note = "= auto" if name == "single" and _key(plan) == _key(plans.auto) else ""
        if plan.num_stages % 2:
            note = f"{plan.num_stages} stage(s): not run on 2 ranks"
        rows.append(Timed(plans.label, lim, "2 ranks", name, plan, plan.iteration_time,
                          times.get(_key(plan), []), note=note))
    return rows


def _modes(plan: Plan) -> str:
    """One mode, or a letter per stage, and the layers recomputed in segments ([Note: recomputed
    layers])."""
    alone = f" + {len(plan.recompute_layers)} layers alone" if plan.recompute_layers else ""
    if isinstance(plan.recompute, str):
        return plan.recompute + alone
    return ",".join(m[0] for m in plan.recompute) + alone  # a = always, e = except_last, n = never


def measured_table(rows: Sequence[Timed]) -> str:
    import statistics

    lines = ["| example | memory limit | run on | plan | stages, M x rows, schedule, recomputation | "
             "predicted ms: plan / as run | measured ms: median (min-max) | measured / predicted | "
             "auto faster by: measured (predicted) |",
             "|---|---:|---|---|---|---:|---:|---:|---:|"]
    auto: dict[tuple[str, str], Timed] = {(r.example, r.runtime): r for r in rows if r.name == "auto"}
    for r in rows:
        p = r.plan
        config = (f"{p.num_stages}, {p.chunks} x {p.micro_batch_size}, {p.schedule}, {_modes(p)}"
                  + (f" ({r.note})" if r.note else ""))
        fits = "" if _fits(p, r.limit) else " (over the limit)"
        med = statistics.median(r.times) if r.times else None
        measured = f"{med:.1f} ({min(r.times):.1f}-{max(r.times):.1f})" if med is not None else "-"
        ratio = f"{med / r.as_run_ms:.2f}" if med is not None else "-"
        a = auto[(r.example, r.runtime)]
        gain = "-"
        if r.name != "auto" and med is not None and a.times:
            gain = (f"{med / statistics.median(a.times):.2f}x ({r.as_run_ms / a.as_run_ms:.2f}x)")
        lines.append(f"| {r.example} | {format_bytes(r.limit)} | {r.runtime} | {r.name}{fits} | {config} | "
                     f"{p.iteration_time:.1f} / {r.as_run_ms:.1f} | {measured} | {ratio} | {gain} |")
    return "\n".join(lines)


def measured_main(args: argparse.Namespace) -> str:
    rows: list[Timed] = []
    comm: dict[str, Any] = {}
    if not args.no_ranks:  # [Note: measured transfer], once: the ranks' plans are made with it
        from autopipe.frontend.profiling.spawned.comm import measure_comm

        comm = measure_comm("cpu", chunks=4 * RECIPE_DEVICES)
    for example in args.examples:
        batch = args.measured_batch or MEASURED_BATCH[example]
        prof = measured_profile(example, batch, args.profile_repeats)
        plans = measured_plans(example, prof, args.fraction)
        rank_plans = (measured_plans(example, rank_profile(example, prof, comm), args.fraction)
                      if comm else None)
        rows += measure(plans, args.steps, args.warmup, ranks=not args.no_ranks, rank_plans=rank_plans)
    head = (f"Measured on CPU: 1 thread per process, {args.steps} steps after {args.warmup}; "
            f"memory limit {args.fraction:.2f} of the way from the GPipe recipe's peak to never-"
            f"recompute's at M = {4 * RECIPE_DEVICES}. 1 process runs gpipe only, its stages "
            "taking turns on one CPU (\"as run\": pipe.plan re-simulated for it). B: rows per "
            "mini-batch; r: the profile's measured recompute / forward time.")
    out = head + "\n\n" + measured_table(rows)
    print(out)
    return out


def main(argv: Sequence[str] | None = None) -> str:
    use_host_allocator("retain")  # as the CLI does: [Note: freed memory stays in the process]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5, 0.35])
    parser.add_argument("--dag-blocks", type=int, default=25, help="8 x blocks + 2 layers")
    parser.add_argument("--dag-batch", type=int, default=64)
    parser.add_argument("--dag-chunks", type=int, default=8)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--llama-profile", default=None, help="NAME: read NAME.csv if it exists, else write it")
    add_llama_arguments(parser)
    parser.add_argument("--measured", action="store_true",
                        help="run the bundled examples' plans on CPU instead (see the docstring)")
    parser.add_argument("--examples", nargs="+", default=["mlp", "gpt", "cnn"],
                        choices=sorted(MEASURED_BATCH))
    parser.add_argument("--batch-size", dest="measured_batch", type=int, default=0,
                        help="--measured: rows per mini-batch (default per example)")
    parser.add_argument("--fraction", type=float, default=0.3,
                        help="--measured: the limit, from the recipe's peak (0) to never's at M = 8 (1)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-ranks", action="store_true", help="--measured: one process only")
    parser.add_argument("--profile-repeats", type=int, default=5, help="--measured: timed runs per layer")
    args = parser.parse_args(argv)
    if args.measured:
        return measured_main(args)
    rows = compare(f"transformer DAG, {8 * args.dag_blocks + 2} layers",
                   dag_profile(args.dag_blocks, args.dag_batch, args.dag_chunks), args.devices, args.fractions)
    if not args.no_llama:
        prof = llama_profile(args)
        rows += compare(f"Llama {args.layers} x {args.hidden}, {len(prof)} layers", prof, args.devices,
                        args.fractions)
    out = table(rows)
    print(out)
    return out


if __name__ == "__main__":
    main()
