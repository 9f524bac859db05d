"""Pipeline x data parallel, planned together, against pure pipeline and pure data parallel.

    python benchmarks/ppdp.py                               # 202-layer DAG + TinyLlama-1.1B's shape
    python benchmarks/ppdp.py --no-llama                    # the synthetic profiles only (no torch)
    python benchmarks/ppdp.py --llama-profile profiles/llama1b   # profile once, reuse
    python benchmarks/ppdp.py --no-llama --measured         # and 4 gloo ranks measured on CPU

Simulated part: for each profile, device count N and per-device memory limit,
``partition(devices=N, data_parallel="auto", chunks="auto", recompute="auto",
schedule="auto")`` (D replicas of a K = N / D stage pipeline, the global batch split over the
replicas: [Note: pipeline x data parallel] in autopipe/core/data_parallel.py) is compared, by simulated
time per global batch (autopipe.core.simulator), with the same search held at

- pure pipeline: ``data_parallel=1``, one N-stage pipeline;
- pure data parallel: ``data_parallel=N``, N copies of the whole model (K = 1), when it fits.

Memory limits are fractions of what the whole model needs on one device (its state and the
activations of one never-recomputed micro-batch of the replica's rows), so some limits let pure
data parallel fit and some do not. Collectives and transfers run at ``--bandwidth`` bytes/s.
The Llama-1B-class profile is measured layer by layer on a model built on the meta device, as
benchmarks/auto_plan.py does (torch and transformers needed); the DAG and the random chain are
autopipe.solvers.synthetic's. Times are the profiled device's (a CPU core for the Llama
profile), scaled by ``--speed``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopipe.core.devices import DeviceSpec
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.units import format_bytes
from autopipe.errors import AutopipeError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain, transformer_dag

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, run or imported
import auto_plan  # noqa: E402 - after the path it is found on
from auto_plan import add_llama_arguments  # noqa: E402

__all__ = ["main", "Row", "simulated_rows", "simulated_table"]

AUTO: dict[str, Any] = dict(chunks="auto", recompute="auto", schedule="auto", progress=False)


@dataclass
class Row:
    profile: str
    devices: int
    limit: int
    planned: Plan
    seconds: float
    pipeline: Plan | None  # None: does not fit
    data: Plan | None  # pure data parallel; None: does not fit
    fsdp: Plan | None  # the planned search with dp_mode="fsdp"


def dag_profile(blocks: int, batch: int, chunks: int) -> Profile:
    prof = transformer_dag(blocks, hidden_bytes=4 << 20)
    prof.meta.update(micro_batch_size=-(-batch // chunks), batch_size=batch, chunks=chunks)
    return prof


def chain_profile(layers: int, batch: int, chunks: int) -> Profile:
    prof = random_chain(layers, seed=3)
    prof.meta.update(micro_batch_size=-(-batch // chunks), batch_size=batch, chunks=chunks)
    return prof


def llama_profile(args: argparse.Namespace) -> Profile:
    """benchmarks/auto_plan.py's meta-built, layer-by-layer Llama profile (its flags are ours)."""
    prof: Profile = auto_plan.llama_profile(args)
    return prof


def _whole_model(prof: Profile, batch: int, speed: float) -> int:
    """What one device needs for the whole model, never recomputed, on ``batch`` rows in one
    micro-batch: pure data parallel's replica at M = 1."""
    plan = partition(prof, devices=[DeviceSpec("one", None, speed)], chunks=1, batch_size=batch,
                     recompute="never", method="dp", progress=False)
    return max(plan.stage_memory)


def _try(prof: Profile, **kw: Any) -> Plan | None:
    try:
        return partition(prof, **kw)
    except AutopipeError:
        return None


def simulated_rows(name: str, prof: Profile, devices: Sequence[int], fractions: Sequence[float],
                   batch: int, bandwidth: float, speed: float) -> list[Row]:
    """The planned (D, K) and the pure pipeline / pure data parallel plans, per N and limit."""
    rows = []
    for n in devices:
        pool = [DeviceSpec(f"gpu:{i}", None, speed) for i in range(n)]
        whole = _whole_model(prof, batch // n, speed)
        for fraction in fractions:
            limit = int(whole * fraction)
            limit = limit >> 20 << 20 if limit >= 1 << 24 else limit  # whole MiB for real sizes
            common: dict[str, Any] = dict(devices=pool, batch_size=batch, memory_limit=limit,
                                          bandwidth=bandwidth, **AUTO)
            start = time.perf_counter()
            try:
                planned = partition(prof, data_parallel="auto", **common)
            except AutopipeError as err:
                print(f"{name}, {n} devices at {format_bytes(limit)}: {err}", file=sys.stderr)
                continue
            seconds = time.perf_counter() - start
            rows.append(Row(name, n, limit, planned, seconds,
                            _try(prof, data_parallel=1, **common),
                            _try(prof, data_parallel=n, **common),
                            _try(prof, data_parallel="auto", dp_mode="fsdp", **common)))
    return rows


def _shape(plan: Plan) -> str:
    """``D x K``: replicas x devices each; an interleaved plan's stages follow in brackets."""
    ranks = len({d.name for d in plan.devices})
    stages = f" ({plan.num_stages} stages)" if plan.num_stages != ranks else ""
    return f"{plan.data_parallel} x {ranks}{stages}, M={plan.chunks}, {plan.schedule}"


def _versus(other: Plan | None, planned: Plan) -> str:
    if other is None:
        return "does not fit | "
    return f"{other.iteration_time:.1f} | {other.iteration_time / planned.iteration_time:.2f}x"


def simulated_table(rows: Sequence[Row]) -> str:
    """One markdown row per (profile, N, limit): the planned D x K and the speedups over pure
    pipeline and pure data parallel (simulated ms per global batch)."""
    lines = ["| profile | N | memory limit | planned D x K, M, schedule | planned ms | search s | "
             "pure pipeline (1 x N) ms | speedup | pure data parallel (N x 1) ms | speedup | "
             "fsdp: planned D x K | fsdp ms |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        fsdp = (f"{_shape(r.fsdp)} | {r.fsdp.iteration_time:.1f}" if r.fsdp is not None
                else "does not fit | ")
        lines.append(f"| {r.profile} | {r.devices} | {format_bytes(r.limit)} | {_shape(r.planned)} | "
                     f"{r.planned.iteration_time:.1f} | {r.seconds:.2f} | "
                     f"{_versus(r.pipeline, r.planned)} | {_versus(r.data, r.planned)} | {fsdp} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16])
    p.add_argument("--fractions", type=float, nargs="+", default=[1.5, 0.6, 0.3],
                   help="memory limits as fractions of the whole model on one device")
    p.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s of every link")
    p.add_argument("--speed", type=float, default=1.0, help="device speed over the profiled one")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dag-blocks", type=int, default=25, help="8 x blocks + 2 layers")
    p.add_argument("--chain-layers", type=int, default=200)
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--measured", action="store_true",
                   help="also 4 gloo CPU ranks as 1x4, 2x2, 4x1 (benchmarks/ppdp_measured.py; its "
                        "own flags there)")
    # the Llama profile: benchmarks/auto_plan.py's flags and defaults (TinyLlama-1.1B's shape)
    p.add_argument("--llama-profile", default=None, help="NAME: read NAME.csv if it exists, else write it")
    add_llama_arguments(p)
    return p


def simulated(args: argparse.Namespace) -> str:
    """The simulated part: every profile's rows as one markdown table."""
    b = args.global_batch
    profiles = [(f"transformer DAG, {8 * args.dag_blocks + 2} layers", dag_profile(args.dag_blocks, b, 8)),
                (f"random chain, {args.chain_layers} layers", chain_profile(args.chain_layers, b, 8))]
    if not args.no_llama:
        prof = llama_profile(args)
        profiles.append((f"Llama {args.layers} x {args.hidden}, {len(prof)} layers", prof))
    rows = [row for name, prof in profiles for row in simulated_rows(
        name, prof, args.devices, args.fractions, b, args.bandwidth, args.speed)]
    return simulated_table(rows)


def main(argv: Sequence[str] | None = None) -> str:
    args = parser().parse_args(argv)
    out = simulated(args)
    if args.measured:
        from ppdp_measured import measured_table  # by name: the spawned ranks import it so

        out += "\n\n" + measured_table()
    print(out)
    return out


if __name__ == "__main__":
    main()
