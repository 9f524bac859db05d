"""A 1B-class HF Llama that is never materialised: build on meta, trace, profile, partition.

    python benchmarks/giant.py                       # TinyLlama-1.1B's shape, 8 stages
    python benchmarks/giant.py --layers 4 --hidden 256 --intermediate 512 --vocab 1000
    python benchmarks/giant.py --layers 80 --hidden 8192 --intermediate 28672 --heads 64 --kv-heads 8 \
        --estimate h100 --precision bf16     # the Llama-70B shape estimated for an H100, on this CPU
    autopipe profile benchmarks.giant:llama70b --estimate h100 --batch-size 16 --chunks 8 --precision bf16
                                             # the same from the command line (llama405b: the 405B's)

Each phase runs in this process, one after the other; the table reports its wall time and the
process's peak anonymous resident memory while it ran (RssAnon: [Note: RssAnon] in
autopipe/frontend/profiling/harness/process_memory.py), next to the model's fp32 bytes, which no phase allocates.
Profiling is layer by layer on the CPU with identical decoder blocks measured once
([Note: layer by layer], [Note: identical layers]); an estimate's trace is two and three decoder
blocks, the rest repeated, as profile(estimate=) traces ([Note: repeated blocks]).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import autopipe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
from auto_plan import add_llama_arguments, llama_config  # noqa: E402 - after the path it is found on

from autopipe.core.units import format_bytes
from autopipe.frontend.profiling.harness.process_memory import PeakRss


@dataclass
class Phase:
    name: str
    seconds: float
    peak_bytes: int | None
    note: str = ""


def _timed(name: str, fn: Callable[[], Any], phases: list[Phase]) -> Any:
    start = time.perf_counter()
    with PeakRss() as rss:
        value = fn()
    phases.append(Phase(name, time.perf_counter() - start, rss.bytes))
    return value


# the two shapes of docs/benchmarks.md, as flags of this script and as factories of the command line
LLAMA_70B = ["--layers", "80", "--hidden", "8192", "--intermediate", "28672", "--heads", "64", "--kv-heads", "8",
             "--seq", "4096"]
LLAMA_405B = ["--layers", "126", "--hidden", "16384", "--intermediate", "53248", "--heads", "128", "--kv-heads",
              "8", "--vocab", "128256", "--seq", "4096"]


def _shape(flags: list[str], batch_size: int) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    args = _parser().parse_args([*flags, "--batch", str(batch_size)])
    model = transformers.LlamaForCausalLM(llama_config(args))  # on meta under `autopipe profile --estimate`
    return model, torch.randint(0, args.vocab, (args.batch, args.seq))


def llama70b(batch_size: int = 16) -> tuple[torch.nn.Module, torch.Tensor]:
    """``autopipe profile benchmarks.giant:llama70b --estimate h100``: the Llama-70B shape."""
    return _shape(LLAMA_70B, batch_size)


def llama405b(batch_size: int = 16) -> tuple[torch.nn.Module, torch.Tensor]:
    """``autopipe profile benchmarks.giant:llama405b --estimate h100``: the Llama 3.1 405B shape."""
    return _shape(LLAMA_405B, batch_size)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_llama_arguments(parser, seq=128, batch=8)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="where each layer is profiled (cuda: peak "
                        "max_memory_allocated is reported in the profile's metadata)")
    parser.add_argument("--estimate", metavar="SHEET", help="estimate each layer on this device sheet instead "
                        "of measuring it ([Note: counted, not timed]): nothing runs on --device")
    parser.add_argument("--precision", default="fp32", help="the profile's precision (fp32, bf16, fp16)")
    parser.add_argument("--devices", type=int, default=64, help="with --estimate: the devices partition "
                        "--stages auto --chunks auto --recompute auto plans for (default 64; 0: no partition)")
    parser.add_argument("--save-profile", default=None, metavar="NAME", help="also write the profile to "
                        "NAME.csv / NAME.json (benchmarks/partition_speed.py --default --profile NAME:K)")
    return parser


def main(argv: Sequence[str] | None = None) -> list[Phase]:
    args = _parser().parse_args(argv)
    import transformers

    torch.set_num_threads(args.threads)
    config = llama_config(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    phases: list[Phase] = []

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    model = _timed("build on meta", build, phases)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    micro = ids[: -(-args.batch // args.chunks)]
    # an estimate traces as profile(estimate=) does: two and three blocks, the rest repeated
    graph = _timed("trace", lambda: autopipe.trace(model, (micro,), repeated=bool(args.estimate)), phases)
    how = {"estimate": args.estimate} if args.estimate else {"repeats": args.repeats, "warmup": 1, "device": args.device}
    prof = _timed(f"profile ({'estimated on ' + args.estimate if args.estimate else 'layer by layer'})",
                  lambda: autopipe.profile(model, (ids,), chunks=args.chunks, graph=graph, progress=False,
                                           precision=args.precision, **how), phases)
    if args.save_profile:
        prof.save(args.save_profile)
    peak = prof.meta.get("peak_memory_bytes")
    phases[-1].note = (f"{prof.meta['measured_layers']} of {len(prof)} layers "
                       + ("counted" if args.estimate else f"measured, {prof.meta['mode']} on {args.device}; peak "
                          f"{format_bytes(peak) if peak is not None else 'n/a'} ({prof.meta.get('peak_memory_of')})"))
    if args.estimate and not args.devices:
        plan = None
    elif args.estimate:  # what a cluster of the sheet's devices runs: every choice the planner's
        plan = _timed(f"partition: stages, chunks, recompute auto on {args.devices} devices",
                      lambda: autopipe.partition(prof, stages="auto", devices=args.devices, chunks="auto",
                                                 recompute="auto", progress=False), phases)
    else:
        plan = _timed(f"partition into {args.stages} stages", lambda: autopipe.partition(
            prof, stages=args.stages, chunks=args.chunks, progress=False), phases)
    if plan is not None:
        phases[-1].note = (f"{plan.num_stages} stages, {plan.chunks} micro-batches, {plan.method}, bottleneck "
                           f"{plan.bottleneck:.1f} ms, step {plan.iteration_time / 1e3:.2f} s, peak "
                           f"{format_bytes(max(plan.device_memory.values(), default=0))} per device, "
                           f"{plan.solver.status}")
        if args.estimate:
            print(plan.explain().splitlines()[0])
    total = sum(p.seconds for p in phases)
    print(f"HF Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: "
          f"{format_bytes(size)} of fp32 parameters on the meta device; batch {args.batch} x "
          f"{args.seq} tokens in {args.chunks} micro-batches; torch {torch.__version__}, "
          f"{args.threads} threads\n")
    print("| phase | seconds | peak RssAnon | |")
    print("|---|---:|---:|---|")
    for p in phases:
        peak = format_bytes(p.peak_bytes) if p.peak_bytes is not None else "n/a"
        print(f"| {p.name} | {p.seconds:.1f} | {peak} | {p.note} |")
    print(f"| all | {total:.1f} | | |")
    return phases


if __name__ == "__main__":
    main()
