"""autopipe's plan for the Llama 3.1 70B and 405B shapes beside torchtitan's published meshes, all
in autopipe's simulator, on estimated profiles ([Note: tensor-parallel cost]).

    python3 benchmarks/torchtitan_tp.py --shape 70b --profile /tmp/l70     # 256 GPUs, FSDP 32 x TP 8
    python3 benchmarks/torchtitan_tp.py --shape 405b --profile /tmp/l405   # 512 GPUs, FSDP 8 x TP 8 x PP 8
    python3 benchmarks/torchtitan_tp.py --shape 70b --layers 4             # a quick look, 4 layers

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (end of 2024; H100s of 96 GB HBM2e at
2.4 TB/s, 500 W, 8 per host over NVLink, 400 Gb/s per GPU between hosts; sequence 8192, full
activation checkpointing, torch.compile and Float8): Table 4, Llama 3.1 70B on 256 GPUs, FSDP 32 x
TP 8, local batch 16 (global 512): 829 tokens/s per GPU, 71.9 GiB; Table 5, Llama 3.1 405B on 512
GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256): 1F1B 100 tokens/s per GPU, 82.5 GiB;
interleaved 1F1B 128, 72.7 GiB.

Here: the model built on the meta device, one row of 8192 tokens estimated in bf16 on the
``h100`` sheet with torchtitan's memory and bandwidth (benchmarks/torchtitan_h100.py's
``titan_sheet``); the TP link the sheet's NVLink, the replicas' and stages' its NICs. Their
meshes are evaluated as they run them: FSDP (``dp_mode="fsdp"``), the stages split by equal
transformer-block counts, one micro-batch of the local batch without PP and micro-batches of
one row with it, every transformer block recomputed alone, each its own segment (full activation
checkpointing: one checkpoint per block). autopipe's row: the fastest of ``partition(stages=K,
tensor_parallel=T, data_parallel=D, ...)`` over every mesh K x T x D of the GPUs with K <= 16 and
T <= 8, each pipeline under 1F1B and under interleaved 1F1B (2K stages), the split, the micro-batches (down to one row) and the recomputation (``"auto"``: whole
stages, single layers, or blocks alone where nothing else fits) chosen by the planner, FSDP,
within the sheet's 96 GiB. Memory limits are lifted on their meshes so that a row prints what it
needs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import autopipe
from autopipe.core.layer_costs import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at, rows_for
from autopipe.core.tensor_parallel import at_degree, check_degree, tp_link
from autopipe.core.transfer import DEFAULT_BANDWIDTH
from autopipe.errors import PartitionError
from autopipe.solvers.baselines import kept_whole, uniform_sizes
from autopipe.solvers.block_recompute import repeated_blocks
from autopipe.solvers.tensor_parallel_search import with_degree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchtitan_h100 import titan_sheet  # noqa: E402 - after the path it is found on

SEQ = 8192
SHAPES = {  # layers, hidden, intermediate, heads, kv heads
    "70b": (80, 8192, 28672, 64, 8),
    "405b": (126, 16384, 53248, 128, 8),
}
# GPUs, global batch, their mesh (TP, PP, DP), micro-batches, schedules, published tokens/s (GiB)
TITAN = {
    "70b": (256, 512, (8, 1, 32), 1, {"gpipe": (829, 71.9)}),
    "405b": (512, 256, (8, 8, 8), 32, {"1f1b": (100, 82.5), "interleaved1f1b": (128, 72.7)}),
}
GIB = 2**30


def estimated(shape: str, layers: int | None, path: str | None, seq: int = SEQ) -> Profile:
    """One row of ``seq`` tokens of the shape, estimated on torchtitan's H100 (cached at ``path``)."""
    if path and Path(path).with_suffix(".csv").exists():
        return Profile.load(path)
    import transformers

    transformers.logging.set_verbosity_error()
    n, hidden, inter, heads, kv = SHAPES[shape]
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers or n, num_attention_heads=heads,
                                      num_key_value_heads=kv, max_position_embeddings=seq, rope_theta=500000.0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128256, (1, seq))
    prof = autopipe.profile(model, (ids,), chunks=1, estimate=titan_sheet(), precision="bf16", progress=False)
    if path:
        prof.save(path, overwrite=True)
    return prof


def theirs(prof: Profile, shape: str, schedule: str, sequence: bool = False) -> Plan:
    """torchtitan's mesh in autopipe's simulator: stages of equal block counts (two a rank when
    interleaved), FSDP, every transformer block recomputed alone, the norms split by tokens where
    ``sequence`` (their TP plan's SequenceParallel); evaluated, not searched."""
    gpus, batch, (t, k, d), chunks, _ = TITAN[shape]
    stages = 2 * k if schedule == "interleaved1f1b" else k
    bandwidth = LayerCosts.from_profile(prof).comm_bandwidth or DEFAULT_BANDWIDTH  # partition's "measured"
    replica = batch // d
    check_degree(prof, t, gpus, 8)
    rank = profile_at(at_degree(prof.for_runtime(None), t, tp_link(prof, bandwidth), sequence),
                      rows_for(replica, chunks), batch_size=replica, chunks=chunks)
    names = prof.layers
    # one checkpoint per transformer block, as their full AC wraps them (a profile without named
    # blocks: every layer but the last, one segment a stage)
    blocks = repeated_blocks(names) or [list(range(len(names) - 1))]
    # stages of equal block counts, cut where a block begins (their split points name blocks);
    # without as many blocks as stages, of equal layer counts, kept off the TP groups
    if len(blocks) >= stages:
        cuts = [0, *(blocks[round(s * len(blocks) / stages)][0] for s in range(1, stages)), len(names)]
    else:
        forbidden = LayerCosts.from_profile(rank).forbidden_cuts("share")
        cuts = [0, *np.cumsum(kept_whole(uniform_sizes(len(names), stages), forbidden, "uniform")).tolist()]
    split = [names[cuts[s]:cuts[s + 1]] for s in range(stages)]
    devices = [f"cuda:{(s % k) * t}" for s in range(stages)]  # stage s on rank s % k, as torch places them
    every, starts = [names[i] for b in blocks for i in b], [names[b[0]] for b in blocks]
    plan = Plan.from_stages(rank, split, devices=devices, chunks=chunks, recompute="never", bandwidth=bandwidth,
                            data_parallel=d, dp_mode="fsdp", recompute_layers=every, segment_starts=starts,
                            schedule=schedule, method="uniform")
    return with_degree(plan, t, sequence)


def ours(prof: Profile, shape: str, most_stages: int, sequence: bool = False) -> tuple[Plan | None, list[str]]:
    """The fastest plan that fits over the meshes PP x TP x DP of the GPUs with at most
    ``most_stages`` pipeline ranks, TP inside a host of 8 (and split by tokens where
    ``sequence``), each pipeline under 1F1B and interleaved 1F1B (two stages a rank)."""
    gpus, batch, *_ = TITAN[shape]
    best: Plan | None = None
    tried = []
    meshes = [(k, t, schedule) for k in (1, 2, 4, 8, 16) if k <= most_stages for t in (1, 2, 4, 8)
              for schedule in (("1f1b", "interleaved1f1b") if k > 1 else ("gpipe",))]
    for k, t, schedule in meshes:
        d = gpus // (k * t)
        if batch % d:
            continue
        stages = 2 * k if schedule == "interleaved1f1b" else k
        name = f"PP {k} x TP {t} x DP {d}, {schedule}"
        start = time.perf_counter()
        try:
            plan = autopipe.partition(prof, stages=stages, devices=gpus, tensor_parallel=t, data_parallel=d,
                                      dp_mode="fsdp", chunks="auto", batch_size=batch, recompute="auto",
                                      schedule=schedule, max_chunks=batch // d, method="exact",
                                      sequence_parallel=sequence and t > 1, progress=False)
        except PartitionError as err:
            tried.append(f"{name}: {str(err).splitlines()[0][:100]}")
            print(tried[-1], file=sys.stderr, flush=True)
            continue
        tried.append(f"{name}: {plan.iteration_time / 1e3:.2f} s, "
                     f"{max(plan.device_memory.values()) / GIB:.1f} GiB ({time.perf_counter() - start:.0f} s to plan)")
        print(tried[-1], file=sys.stderr, flush=True)
        if best is None or plan.iteration_time < best.iteration_time:
            best = plan
    return best, tried


def row(name: str, plan: Plan, gpus: int, batch: int, seq: int, published: str) -> str:
    step = plan.iteration_time / 1e3
    tps = batch * seq / step / gpus
    memory = plan.highest_memory / GIB
    k = len({d.name for d in plan.devices})
    mesh = f"PP {k} x TP {plan.tensor_parallel} x DP {plan.data_parallel} ({plan.num_stages} stages)"
    fits = "yes" if memory <= titan_sheet().memory_bytes / GIB else "no"
    return (f"| {name} | {mesh} | {plan.schedule}, {plan.chunks} x {plan.micro_batch_size} rows, "
            f"{len(plan.recompute_layers)} layers recomputed in {sum(b.recompute_segments for b in plan.breakdown)} "
            f"segments | {step:.2f} | {tps:,.0f} | {memory:.1f} | {fits} | "
            f"{published} |")


def main(argv: Sequence[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="70b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--profile", default=None, help="NAME: read the estimate from NAME.csv, or write it there")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens a row (default torchtitan's 8192)")
    parser.add_argument("--most-stages", type=int, default=16, help="autopipe's meshes: at most this many stages")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="every TP mesh, theirs and autopipe's, splits its norms by tokens too")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    prof = estimated(args.shape, args.layers, args.profile, args.seq)
    took = time.perf_counter() - started
    gpus, batch, _, _, published = TITAN[args.shape]
    rows = ["| plan | mesh | schedule, micro-batches, recomputation | step s | tokens/s per GPU | GiB per GPU "
            "| fits 96 GiB | torchtitan published: tokens/s per GPU (GiB) |",
            "|---|---|---|---:|---:|---:|---|---|"]
    for schedule, (tps, gib) in published.items():
        rows.append(row(f"torchtitan's, {schedule}", theirs(prof, args.shape, schedule, args.sequence_parallel), gpus, batch, args.seq,
                        f"{tps} ({gib})"))
    start = time.perf_counter()
    plan, tried = ours(prof, args.shape, args.most_stages, args.sequence_parallel)
    rows.append(row("autopipe's", plan, gpus, batch, args.seq, "") if plan is not None else
                "| autopipe's | none of its meshes fits 96 GiB | | | | | no | |")
    print("\n".join(rows))
    print(f"\n{args.shape} shape, {args.layers or SHAPES[args.shape][0]} layers, {len(prof)} autopipe layers, "
          f"estimated in {took:.0f} s; autopipe's meshes planned in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    if plan is not None:
        print(plan.explain(), file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
