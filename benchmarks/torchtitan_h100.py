"""autopipe's estimate beside torchtitan's published Llama 3.1 runs on H100 (the FSDP-only rows).

    python3 benchmarks/torchtitan_h100.py                  # Llama 3.1 8B, Tables 1 and 3
    python3 benchmarks/torchtitan_h100.py --layers 2       # a quick look: the 8B's layers, 2 of them

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (end of 2024): Table 1, Llama 3.1 8B on
8 GPUs, FSDP, local batch 2 (global 16), selective activation checkpointing: 5,762 tokens/s per
GPU and 82.4 GiB; Table 3, the same on 128 GPUs (global 256): 5,605 and 67.0 GiB; each also with
torch.compile and with torch.compile + Float8. Their H100s have 96 GB of HBM2e at 2.4 TB/s at a
500 W limit, peak FLOP/s "between SXM and NVL"; 8 per host over NVLink, 400 Gb/s per GPU
between hosts. Every other table needs tensor parallelism, which autopipe does not plan yet.

Here: the model built on the meta device from Llama 3.1 8B's config, one replica's micro-batch
(2 x 8192 tokens: no pipeline, so no micro-batching) estimated in bf16 on the shipped ``h100``
sheet with their memory (96 GiB) and bandwidth (2.4 TB/s) written in (its peaks stay the SXM's:
an upper bound on theirs), then ``partition(stages=1, devices=D, data_parallel=D,
dp_mode="fsdp")`` with the sheet's link between the replicas (NVLink on 8 GPUs, the NICs on 128)
and each recomputation mode autopipe has (none, and every layer recomputed alone:
``recompute_layers``), the memory limit lifted so that a row prints what it needs. Predicted
tokens/s per GPU = local batch x sequence / the simulated iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

import torch

import autopipe
from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.units import format_bytes

__all__ = ["main", "SEQ", "PUBLISHED", "titan_sheet"]

SEQ, LOCAL_BATCH = 8192, 2
# devices -> (tokens/s per GPU, GiB) for FSDP, FSDP + torch.compile, FSDP + torch.compile + Float8
PUBLISHED = {8: ((5762, 82.4), (6667, 77.0), (8532, 76.8)), 128: ((5605, 67.0), (6514, 62.0), (8380, 61.8))}


def titan_sheet() -> DeviceSheet:
    """The shipped H100 sheet with the memory and bandwidth of torchtitan's H100s."""
    sheet = load_sheet("h100")
    sources = {**sheet.sources,
               "memory_bytes": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96GB HBM2e per H100",
               "memory_bandwidth": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 2.4 TB/sec peak"}
    return dataclasses.replace(sheet, name="h100-titan", device="NVIDIA H100 96GB HBM2e (torchtitan's, 500 W)",
                               memory_bytes=96 * 2**30, memory_bandwidth=2.4e12, sources=sources)


def llama31_8b(layers: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=SEQ, rope_theta=500000.0)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def plans(prof: Profile, devices: int, sheet: DeviceSheet) -> dict[str, Plan]:
    """One FSDP replica per device, each mode of recomputation autopipe has."""
    link = sheet.intra_host_bandwidth if devices <= 8 else sheet.inter_host_bandwidth
    common = dict(stages=1, devices=devices, data_parallel=devices, dp_mode="fsdp", chunks=1,
                  batch_size=LOCAL_BATCH * devices, memory_limit=2**60, bandwidth=link, progress=False)
    never = autopipe.partition(prof, recompute="never", **common)
    layers = [n for n in prof.layers if n != prof.layers[-1]]  # every layer but the head recomputed alone
    every = Plan.from_stages(prof, never.stages, devices=never.devices, chunks=1, recompute="never",
                             bandwidth=link, data_parallel=devices, dp_mode="fsdp", recompute_layers=layers)
    return {"no recomputation": never, "every layer recomputed": every}


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (Llama 3.1 8B: 32)")
    parser.add_argument("--seq", type=int, default=SEQ)
    args = parser.parse_args(argv)
    sheet = titan_sheet()
    model = llama31_8b(args.layers)
    ids = torch.randint(0, 128256, (LOCAL_BATCH, args.seq))
    started = time.perf_counter()
    prof = autopipe.profile(model, (ids,), chunks=1, estimate=sheet, precision="bf16", progress=False)
    took = time.perf_counter() - started
    rows = ["| GPUs | published: FSDP / + compile / + compile + Float8, tokens/s per GPU (GiB) | autopipe: "
            "recomputation | tokens/s per GPU | step s | GiB per GPU |", "|---:|---|---|---:|---:|---:|"]
    for devices, published in PUBLISHED.items():
        theirs = " / ".join(f"{tps:,} ({gib})" for tps, gib in published)
        for mode, plan in plans(prof, devices, sheet).items():
            tps = LOCAL_BATCH * args.seq / (plan.iteration_time / 1e3)
            memory = plan.highest_memory
            rows.append(f"| {devices} | {theirs} | {mode} | {tps:,.0f} | {plan.iteration_time / 1e3:.2f} | "
                        f"{memory / 2**30:.1f} |")
    print("\n".join(rows))
    print(f"\nLlama 3.1 8B shape, {args.layers} layers, {len(prof)} autopipe layers, estimated on {sheet.name} in "
          f"{took:.0f} s (trace included); parameters {format_bytes(float(prof.df['param_bytes'].sum()))} fp32; "
          f"torch {torch.__version__}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
