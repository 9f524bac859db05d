"""Synthetic profiles for tests, benchmarks and documentation: chains and training-like DAGs.

These are deterministic (seeded) stand-ins for measured profiles, shaped like real models: a
GPT-like chain (cheap embedding, equal blocks, heavy head) and a transformer DAG whose blocks
have residual skips around attention and MLP, so values pass through cuts; and the chains that
torch.distributed.pipelining's ``auto_partition`` is tested on, given in FLOPs and bytes
(:func:`torch_workloads`). With ``split=True``
(or ``bwd_input_ms``) they carry the split backward the zero-bubble schedules need ([Note:
split backward time] in autopipe/core/cost.py): a layer with weights spends about half its
backward on its input gradients and keeps its output gradient (``output_bytes``) for its weight
pass; one without weights has no weight pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from autopipe.core.profile_table import Profile

__all__ = ["Workload", "chain_profile", "flops_chain", "random_chain", "torch_workloads", "transformer_dag"]


def chain_profile(
    fwd_ms: Sequence[float],
    *,
    bwd_ms: Sequence[float] | None = None,
    param_bytes: Sequence[int] | None = None,
    output_bytes: Sequence[int] | int = 0,
    saved_bytes: Sequence[int] | int = 0,
    tie_group: Sequence[str] | None = None,
    bwd_input_ms: Sequence[float] | None = None,
    weight_grad_bytes: Sequence[int] | int = 0,
) -> Profile:
    """A chain of layers ``l0, l1, ...``; backward defaults to 2 x forward; ``bwd_input_ms``
    (with ``weight_grad_bytes``) splits it (the rest is the weight part)."""
    n = len(fwd_ms)

    def col(v: Sequence[int] | int) -> list[int]:
        return [v] * n if isinstance(v, int) else [int(x) for x in v]

    df = pd.DataFrame({
        "layer": [f"l{i}" for i in range(n)],
        "fwd_ms": [float(x) for x in fwd_ms],
        "bwd_ms": [2.0 * x for x in fwd_ms] if bwd_ms is None else [float(x) for x in bwd_ms],
        "param_bytes": col(0) if param_bytes is None else col(param_bytes),
        "output_bytes": col(output_bytes),
        "saved_bytes": col(saved_bytes),
    })
    if tie_group is not None:
        df["tie_group"] = list(tie_group)
    if bwd_input_ms is not None:
        df["bwd_input_ms"] = [float(x) for x in bwd_input_ms]
        df["bwd_weight_ms"] = df["bwd_ms"] - df["bwd_input_ms"]
        df["weight_grad_bytes"] = col(weight_grad_bytes)
    return Profile.from_frame(df, meta={"model": "synthetic-chain"})


def random_chain(n: int, seed: int = 0, *, spread: float = 10.0, split: bool = False) -> Profile:
    """n layers with log-uniform costs spanning ``spread`` x, random activations and params;
    ``split``: a random 30-70% of each backward on the input gradients."""
    rng = np.random.default_rng(seed)
    fwd = np.exp(rng.uniform(0, np.log(spread), n))
    bwd = (fwd * rng.uniform(1.5, 2.5, n)).round(3)
    out = rng.integers(1 << 10, 1 << 20, n)
    return chain_profile(
        fwd.round(3).tolist(),
        bwd_ms=bwd.tolist(),
        param_bytes=rng.integers(0, 4 << 20, n).tolist(),
        output_bytes=out.tolist(),
        saved_bytes=rng.integers(1 << 10, 2 << 20, n).tolist(),
        bwd_input_ms=(bwd * rng.uniform(0.3, 0.7, n)).round(3).tolist() if split else None,
        weight_grad_bytes=out.tolist(),
    )


def transformer_dag(blocks: int, seed: int = 0, *, hidden_bytes: int = 1 << 20, split: bool = False) -> Profile:
    """A GPT-like training DAG: embed, ``blocks`` x 8 layers with two residual skips, head;
    ``split``: each backward split (a layer with weights: half of it on the input gradients,
    its output gradient kept for the weight part; the embedding's input needs none).

    Each block is ``ln1 -> attn -> proj -> add1(x, .) -> ln2 -> fc1 -> fc2 -> add2(add1, .)``;
    the residual inputs reach the adds over 3 layers, so a cut inside a block also carries the
    skip. The head is tied to the embedding (``tie_group="wte"``). Layer count: 8 x blocks + 2.
    """
    rng = np.random.default_rng(seed)
    rows: list[dict[str, object]] = []
    edges: list[tuple[str, str, int]] = []
    h = hidden_bytes

    def add(name: str, fwd: float, params: int, out: int, saved: int, tie: str = "") -> str:
        jitter = float(rng.uniform(0.8, 1.2))
        bwd = round(2 * fwd * jitter, 4)
        rows.append({"layer": name, "fwd_ms": round(fwd * jitter, 4), "bwd_ms": bwd,
                     "param_bytes": params, "output_bytes": out, "saved_bytes": saved, "tie_group": tie})
        if split:
            first = not rows[:-1]
            part = 0.0 if first else bwd / 2 if params else bwd
            rows[-1].update(bwd_input_ms=part, bwd_weight_ms=round(bwd - part, 4),
                            weight_grad_bytes=out if params and not first else 0)
        return name

    x = add("embed", 0.2, 16 << 20, h, h, "wte")
    for b in range(blocks):
        p = f"h{b}."
        ln1 = add(p + "ln1", 0.05, 8 << 10, h, h)
        attn = add(p + "attn", 1.0, 12 << 20, h, 4 * h)
        proj = add(p + "proj", 0.3, 4 << 20, h, h)
        add1 = add(p + "add1", 0.02, 0, h, 0)
        ln2 = add(p + "ln2", 0.05, 8 << 10, h, h)
        fc1 = add(p + "fc1", 0.6, 16 << 20, 4 * h, 4 * h)
        fc2 = add(p + "fc2", 0.6, 16 << 20, h, 4 * h)
        add2 = add(p + "add2", 0.02, 0, h, 0)
        edges += [(x, ln1, h), (ln1, attn, h), (attn, proj, h), (proj, add1, h), (x, add1, h),
                  (add1, ln2, h), (ln2, fc1, h), (fc1, fc2, 4 * h), (fc2, add2, h), (add1, add2, h)]
        x = add2
    head = add("head", 1.5, 16 << 20, 8 * h, 8 * h, "wte")
    edges.append((x, head, h))
    return Profile.from_frame(pd.DataFrame(rows), edges=edges, meta={"model": f"transformer-dag-{blocks}"})


def flops_chain(fwd_flops: Sequence[float], comm_bytes: Sequence[int] | int, flops_per_s: float,
                name: str) -> Profile:
    """A chain timed as torch.distributed.pipelining's ``auto_partition`` times one: each layer's
    forward ``fwd_flops / flops_per_s``, its backward twice that, split evenly into input and
    weight gradients; ``comm_bytes`` crossing the cut after each layer but the last. No memory:
    only time is compared on these."""
    n = len(fwd_flops)
    sent = [comm_bytes] * (n - 1) if isinstance(comm_bytes, int) else [int(b) for b in comm_bytes]
    if len(sent) != n - 1:
        raise ValueError(f"{len(sent)} cut sizes for {n} layers: give one per cut (n - 1)")
    fwd = [1e3 * f / flops_per_s for f in fwd_flops]
    prof = chain_profile(fwd, bwd_ms=[2 * f for f in fwd], output_bytes=[*sent, 0], bwd_input_ms=fwd)
    prof.meta["model"] = name
    return prof


@dataclass(frozen=True)
class Workload:
    """A chain to split over ``ranks`` ranks with ``chunks`` micro-batches, transfers at
    ``bandwidth`` bytes/s (None: free), and the schedules torch tested it under (autopipe's
    names)."""

    name: str
    profile: Profile
    bandwidth: float | None
    schedules: tuple[str, ...]
    ranks: int = 4
    chunks: int = 8


# torch's tests time FLOPs on a 312 TFLOP/s device and bytes over a 50 GB/s link
_A100, _LINK = 312e12, 50e9


def torch_workloads() -> list[Workload]:
    """The workloads of torch.distributed.pipelining's ``auto_partition`` tests
    (test/distributed/pipelining/test_partition.py, pytorch#179212), written again as profiles:
    4 ranks, 8 micro-batches, backward twice the forward, half of it the input gradient. Three
    of them are FLOP counts in the thousands, which on the tests' 312 TFLOP/s make compute a
    thousandth of a 128-byte transfer at 50 GB/s; each is also given as ``auto_partition``'s
    defaults read it (one FLOP a time unit, here a microsecond, and no transfer), where the
    split matters."""
    decoder = [2.25e12] * 8  # one dense decoder layer, hidden ~4096, 4096 tokens, bf16
    ramp = [1000.0 * (i + 1) for i in range(8)]
    mixed8 = [1170, 2846, 1146, 4254, 2199, 1289, 6888, 2312]
    heavy12 = [3.424614582864e12, 6.186943846406e12, 6.099927589441e12, 4.961141868353e12,
               6.808911722949e12, 1.723089387674e12, 6.387281953781e12, 5.278282850207e12,
               6.543029278476e12, 3.135416417038e12, 2.027661282943e12, 2.940059633160e12]
    heavy_cuts = [43405107, 180456491, 60605618, 172762728, 164606193, 42130509, 115014477, 34570395,
                  109358683, 41150899, 19768913]
    mixed12 = [3084, 4757, 4139, 1960, 6283, 2830, 3507, 6252, 6451, 2029, 5175, 5108]
    one_f_one_b, interleaved = ("1f1b",), ("1f1b", "interleaved1f1b", "interleaved_zb")
    out = [
        Workload("decoder x8", flops_chain(decoder, 32 << 20, _A100, "decoder x8"), _LINK, interleaved),
        Workload("ramp x8", flops_chain(ramp, 128, _A100, "ramp x8"), _LINK, one_f_one_b),
        Workload("rebalance x8", flops_chain([8, 11, 2, 1, 18, 5, 4, 11], 0, 1e3, "rebalance x8"), 1e3,
                 one_f_one_b),
        Workload("mixed x8", flops_chain(mixed8, 128, _A100, "mixed x8"), _LINK, one_f_one_b),
        Workload("heavy cuts x12", flops_chain(heavy12, heavy_cuts, _A100, "heavy cuts x12"), _LINK,
                 ("interleaved1f1b",)),
        Workload("mixed x12", flops_chain(mixed12, 128, _A100, "mixed x12"), _LINK, ("interleaved_zb",)),
    ]
    for name, flops, schedules in (("ramp x8", ramp, one_f_one_b), ("mixed x8", mixed8, one_f_one_b),
                                   ("mixed x12", mixed12, ("interleaved_zb",))):
        plain = f"{name}, FLOPs as time"
        out.append(Workload(plain, flops_chain(flops, 0, 1e6, plain), None, schedules))
    return out
