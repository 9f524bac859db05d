"""Estimated against measured on this CPU: per-layer time and memory of a profile estimated on a
sheet calibrated here, against the profile measured here, for the bundled examples and HF Llama,
GPT-2, BERT and Mamba built from small configs.

    python3 benchmarks/estimate_accuracy.py                          # calibrate, then every model
    python3 benchmarks/estimate_accuracy.py --sheet sheets/cpu.json --models gpt llama

Both sides run on 1 thread with this process's CPU time as the clock (time.process_time: other
processes on a shared machine cannot inflate it), the calibration ([Note: calibrated sheets] in
autopipe/frontend/profiling/estimated/calibrate.py) included, and glibc keeping freed memory
(``host_allocator="retain"``, as the command line profiles). For each model, one micro-batch:

- ``layers``: the estimate's sum over layers of forward + backward over the measured profile's
  (its rows scaled to the whole graph in sequence, [Note: layers in sequence]);
- ``whole``: the same estimate over one whole-model forward + backward (time_model);
- ``per layer``: the median and the 10th-90th percentile of estimated / measured over the layers
  that take at least 2% of the measured sum;
- ``step``: the simulated iteration of one 2-stage GPipe plan (the measured profile's exact
  split, 4 micro-batches, recomputation except_last) costed on the estimate over costed on the
  measured profile;
- ``memory``: that plan's largest stage memory, estimated over measured, and the summed saved
  bytes of every layer, estimated over measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.examples import get_example
from autopipe.frontend.profiling.estimated.calibrate import calibrate
from autopipe.frontend.profiling.harness.timing import CpuTimer
from autopipe.frontend.profiling.profiler import profile, time_model
from autopipe.solvers.partitioner import partition
from executor.host_allocator import use_host_allocator

__all__ = ["main", "Row", "MODELS"]

BIG = 0.02  # a layer's share of the measured sum from which it counts in the per-layer ratios


def _hf(kind: str, tokens: int) -> Callable[[int], tuple[torch.nn.Module, tuple[Any, ...]]]:
    def build(batch: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        if kind == "llama":
            model: torch.nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=tokens))
        elif kind == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=1000, n_embd=256, n_layer=4, n_head=8, n_positions=tokens,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        elif kind == "mamba":  # its selective scan runs as a Python loop over the tokens: many tiny layers
            model = transformers.MambaForCausalLM(transformers.MambaConfig(
                vocab_size=1000, hidden_size=256, state_size=16, intermediate_size=512, num_hidden_layers=2,
                use_mambapy=False))
        else:
            model = transformers.BertForMaskedLM(transformers.BertConfig(
                vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                intermediate_size=1024, max_position_embeddings=tokens, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0))
        return model, (torch.randint(0, 1000, (batch, tokens)),)
    return build


def _example(name: str) -> Callable[[int], tuple[torch.nn.Module, tuple[Any, ...]]]:
    def build(batch: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        ex = get_example(name, batch)
        return ex.model, ex.inputs if isinstance(ex.inputs, tuple) else (ex.inputs,)
    return build


# name -> (builder, batch, chunks): the bundled examples at profile_accuracy.py's settings
MODELS: dict[str, tuple[Callable[[int], tuple[torch.nn.Module, tuple[Any, ...]]], int, int]] = {
    "mlp": (_example("mlp"), 256, 4), "cnn": (_example("cnn"), 64, 4), "gpt": (_example("gpt"), 32, 4),
    "unet": (_example("unet"), 32, 4), "llama": (_hf("llama", 128), 16, 4), "gpt2": (_hf("gpt2", 128), 16, 4),
    "bert": (_hf("bert", 128), 16, 4), "mamba": (_hf("mamba", 16), 16, 4),
}


@dataclass
class Row:
    model: str
    layers: int
    measured_ms: float
    layers_ratio: float
    whole_ratio: float
    per_layer: tuple[float, float, float]  # 10th percentile, median, 90th
    step_ratio: float
    memory_ratio: float
    saved_ratio: float


def _plan(prof: Profile, stages: list[list[str]] | None) -> Plan:
    if stages is None:
        return partition(prof, stages=2, chunks=4, recompute="except_last", runtime="gpipe", progress=False,
                         bandwidth=None)
    return Plan.from_stages(prof, stages, chunks=4, recompute="except_last", runtime="gpipe",
                            bandwidth=None)


def compare(name: str, sheet: DeviceSheet, repeats: int, warmup: int) -> Row:
    build, batch, chunks = MODELS[name]
    model, inputs = build(batch)
    timer = CpuTimer(time.process_time)
    measured = profile(model, inputs, chunks=chunks, repeats=repeats, warmup=warmup, timer=timer, progress=False)
    estimated = profile(model, inputs, chunks=chunks, estimate=sheet, progress=False)
    fwd, bwd = time_model(model, inputs, chunks=chunks, repeats=repeats, warmup=warmup, timer=timer)
    m = (measured.df["fwd_ms"] + measured.df["bwd_ms"]).to_numpy()
    e = (estimated.df["fwd_ms"] + estimated.df["bwd_ms"]).to_numpy()
    big = [float(b / a) for a, b in zip(m, e, strict=True) if a >= BIG * m.sum()]
    deciles = statistics.quantiles(big, n=10) if len(big) > 1 else [big[0]] * 9
    plan = _plan(measured, None)
    # the same plan costed on the estimate: no call cost, no transfer on either, as executor.GPipe
    again = _plan(estimated.for_runtime("gpipe"), plan.stages)
    base = _plan(measured, plan.stages)
    return Row(name, len(measured), float(m.sum()), float(e.sum() / m.sum()), float(e.sum() / (fwd + bwd)),
               (deciles[0], statistics.median(big), deciles[-1]), again.iteration_time / base.iteration_time,
               max(again.stage_memory) / max(base.stage_memory),
               float(estimated.df["saved_bytes"].sum() / measured.df["saved_bytes"].sum()))


def table(rows: Sequence[Row]) -> str:
    lines = ["| model | layers | measured ms | layers | whole | per layer (p10 / median / p90) | step | "
             "memory | saved bytes |", "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        p10, med, p90 = r.per_layer
        lines.append(f"| {r.model} | {r.layers} | {r.measured_ms:.3f} | {r.layers_ratio:.2f} | {r.whole_ratio:.2f} "
                     f"| {p10:.2f} / {med:.2f} / {p90:.2f} | {r.step_ratio:.2f} | {r.memory_ratio:.3f} "
                     f"| {r.saved_ratio:.3f} |")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sheet", help="a device sheet to estimate on (default: calibrate this CPU first)")
    parser.add_argument("--save-sheet", help="where to save the sheet calibrated here")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    use_host_allocator("retain")  # as the command line: [Note: freed memory stays in the process]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        sheet = load_sheet(args.sheet) if args.sheet else calibrate("cpu", timer=CpuTimer(time.process_time))
        calibrated = time.perf_counter() - started
        if args.save_sheet:
            sheet.save(args.save_sheet, overwrite=True)
        rows = [compare(name, sheet, args.repeats, args.warmup) for name in args.models]
    finally:
        torch.set_num_threads(before)
    print(table(rows))
    print(f"\nsheet {sheet.name} ({'given' if args.sheet else f'calibrated here in {calibrated:.0f} s'}): matmul "
          f"{sheet.efficiency_matmul:.2f}, attention {sheet.efficiency_attention:.2f}, elementwise "
          f"{sheet.efficiency_elementwise:.2f}, launch {sheet.launch_us:.1f} us; commit {_commit()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"1 thread, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
