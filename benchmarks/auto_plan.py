"""The automatic plan against hand-set ones where memory binds (simulated iterations).

    python benchmarks/auto_plan.py                      # 200-layer DAG + TinyLlama-1.1B's shape
    python benchmarks/auto_plan.py --no-llama           # the synthetic DAG only (no torch)
    python benchmarks/auto_plan.py --llama-profile profiles/llama1b   # profile once, reuse

For each profile and memory limit, ``partition(stages="auto", chunks="auto", checkpoint="auto",
schedule="auto")`` on D devices, and the same with ``chunks`` fixed at the profile's (a
"fixed M" row: with one measured micro-batch size the model charges nothing for more, smaller
micro-batches, so chunks="auto" takes many and memory rarely binds; at a fixed M it does), is
compared with two plans a user might set by hand, all simulated by autopipe.core.simulator:

- recompute everywhere, uniform stages: D stages of equal layer counts, ``checkpoint="always"``,
  the profile's micro-batches, GPipe (the safe torchgpipe-style default);
- the best single-mode plan of the same K, M and schedule as the auto plan: the DP split with
  one checkpoint mode for every stage (the fastest of the modes that fit).

Memory limits are fractions of what the fastest never-recompute GPipe split at the profile's
micro-batches needs on its fullest device, so they bind. The Llama-1B-class profile is measured
layer by layer on a model built on the meta device (``autopipe.profile(..., mode="layers")``),
which needs torch and transformers; the DAG is autopipe.solvers.synthetic's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import transformer_dag
from executor.spec import CHECKPOINT_MODES

__all__ = ["main", "Row"]


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


def llama_profile(args: argparse.Namespace) -> Profile:
    """A HF Llama built on meta, profiled layer by layer (saved to / read from --llama-profile)."""
    path = Path(args.llama_profile) if args.llama_profile else None
    if path is not None and path.with_suffix(".csv").exists():
        return Profile.load(path)
    import torch
    import transformers

    import autopipe

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128))
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
    free = partition(prof, devices=pool, chunks=chunks, checkpoint="never", method="dp", progress=False)
    rows = []
    for fraction in fractions:
        limit = int(max(free.stage_memory) * fraction)
        limit = limit >> 20 << 20 if limit >= 1 << 24 else limit  # whole MiB for real sizes
        for chosen in ("auto", chunks):
            start = time.perf_counter()
            try:
                auto = partition(prof, devices=pool, memory_limit=limit, stages="auto", chunks=chosen,
                                 batch_size=int(prof.meta["batch_size"]), checkpoint="auto",
                                 schedule="auto", progress=False)
            except AutopipeError as err:
                print(f"{name} at {format_bytes(limit)}, chunks {chosen}: {err}")
                continue
            seconds = time.perf_counter() - start
            uniform = partition(prof, devices=pool, chunks=chunks, checkpoint="always", method="uniform",
                                memory_limit=limit, progress=False)
            rows.append(Row(name, str(chosen), limit, auto, seconds, uniform, _single(prof, auto)))
    return rows


def _single(prof: Profile, auto: Plan) -> Plan | None:
    """The fastest plan with one checkpoint mode for every stage, at the auto plan's K, M and
    schedule, on its devices."""
    best = None
    for mode in CHECKPOINT_MODES:
        try:
            plan = partition(prof, devices=auto.devices, chunks=auto.chunks, batch_size=auto.batch_size,
                             checkpoint=mode, schedule=auto.schedule, method="dp", progress=False)
        except AutopipeError:
            continue  # this mode does not fit at that K and M
        if best is None or plan.iteration_time < best.iteration_time:
            best = plan
    return best


def _fits(plan: Plan, limit: int) -> bool:
    return max(plan.device_memory.values()) <= limit and max(plan.stage_memory) <= limit


def table(rows: Sequence[Row]) -> str:
    lines = ["| profile | memory limit | chunks | auto: stages, chunks, schedule, recomputation | "
             "auto ms | search s | all recompute, uniform ms | speedup | best single mode, same K "
             "and M | speedup |",
             "|---|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        a = r.auto
        modes = a.checkpoint if isinstance(a.checkpoint, str) else ",".join(
            m[0] for m in a.checkpoint)  # a = always, e = except_last, n = never, per stage
        uni = f"{r.uniform.iteration_time:.1f}" + ("" if _fits(r.uniform, r.limit) else " (over the limit)")
        single = (f"{r.single.checkpoint}: {r.single.iteration_time:.1f} ms" if r.single else "none fits")
        ratio = f"{r.single.iteration_time / a.iteration_time:.2f}x" if r.single else ""
        lines.append(
            f"| {r.profile} | {format_bytes(r.limit)} | {r.chunks} | {a.num_stages}, {a.chunks} of "
            f"{a.micro_batch_size} rows, {a.schedule}, {modes} | {a.iteration_time:.1f} | "
            f"{r.seconds:.2f} | {uni} | {r.uniform.iteration_time / a.iteration_time:.2f}x | "
            f"{single} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.75, 0.5, 0.35])
    parser.add_argument("--dag-blocks", type=int, default=25, help="8 x blocks + 2 layers")
    parser.add_argument("--dag-batch", type=int, default=64)
    parser.add_argument("--dag-chunks", type=int, default=8)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--llama-profile", default=None, help="NAME: read NAME.csv if it exists, else write it")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
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
