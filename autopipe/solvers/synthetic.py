"""Synthetic profiles for tests, benchmarks and documentation: chains and training-like DAGs.

These are deterministic (seeded) stand-ins for measured profiles, shaped like real models: a
GPT-like chain (cheap embedding, equal blocks, heavy head) and a transformer DAG whose blocks
have residual skips around attention and MLP, so values pass through cuts. With ``split=True``
(or ``bwd_input_ms``) they carry the split backward the zero-bubble schedules need ([Note:
split backward time] in autopipe/core/cost.py): a layer with weights spends about half its
backward on its input gradients and keeps its output gradient (``output_bytes``) for its weight
pass; one without weights has no weight pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from autopipe.core.profile_table import Profile

__all__ = ["chain_profile", "random_chain", "transformer_dag"]


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
