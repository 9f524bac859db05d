"""The truth the DAG solvers are checked against: every split, enumerated."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from autopipe.core.corrections import LossCost, Transfer
from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.solvers.synthetic import random_chain


def best_dag_bottleneck(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> float:
    """The least bottleneck (ms) over every split of ``lc``'s DAG into ``len(devices)`` non-empty
    stages that respects its edges, tied layers together under ``ties="colocate"`` and each
    device's memory: each layer's stage enumerated, k^n splits."""
    n, k = len(lc), len(devices)
    best = np.inf
    for a in itertools.product(range(k), repeat=n):
        if len(set(a)) < k or any(a[u] > a[v] for u in range(n) for v in lc.consumers[u]):
            continue
        if opts.ties == "colocate" and any(len({a[v] for v in m}) > 1 for m, _ in lc.tie_groups):
            continue
        costs = stage_costs(lc, list(a), devices, opts)
        if all(d.memory is None or c.memory_bytes <= d.memory for c, d in zip(costs, devices, strict=True)):
            best = min(best, max(c.time_ms for c in costs))
    return float(best)


def with_loss(seed: int, n: int) -> tuple[LayerCosts, LayerCosts]:
    """A random chain whose loss holds (and whose backward has alive) several of its largest
    layer's saves, on ranks for odd seeds, in one process for even; and the same without the
    loss's bytes ([Note: the loss's memory])."""
    prof = random_chain(n, seed)
    big = int(prof.df["saved_bytes"].max())
    transfer = Transfer(0.01, math.inf, 0.5) if seed % 2 else None  # measured: the ranks' runtime
    loss = LossCost(0.5, 1.0, 1, held_bytes=3 * big, peak_bytes=5 * big)
    with_loss = dataclasses.replace(prof, corrections=dataclasses.replace(prof.corrections, loss=loss,
                                                                          transfer=transfer))
    without = dataclasses.replace(with_loss, corrections=dataclasses.replace(
        with_loss.corrections, loss=dataclasses.replace(loss, held_bytes=0, peak_bytes=0)))
    return LayerCosts.from_profile(with_loss), LayerCosts.from_profile(without)


def least_memory(lc: LayerCosts, k: int, opts: CostOptions) -> int:
    """The smallest largest stage memory over every contiguous split into ``k`` stages."""
    n = len(lc)
    return min(max(c.memory_bytes for c in stage_costs(lc, [s for s in range(k) for _ in range(b[s], b[s + 1])],
                                                        [DeviceSpec(str(s)) for s in range(k)], opts))
               for cuts in itertools.combinations(range(1, n), k - 1) for b in [(0, *cuts, n)])


def with_backward(seed: int, n: int, *, split: bool = False) -> tuple[LayerCosts, LayerCosts]:
    """A random chain whose backward's working sets (up to twice a layer's saves) and lazy
    gradients decide its peak, with the loss's bytes for seeds 2 and 3 mod 4, on ranks for odd
    seeds; and the same profile without the working sets, as profiles measured before them
    ([Note: the backward's memory])."""
    rng = np.random.default_rng(seed + 1000)
    prof = random_chain(n, seed, split=split)
    prof.df["bwd_working_bytes"] = (prof.df["saved_bytes"] * rng.uniform(0, 2, n)).astype("int64")
    big = int(prof.df["saved_bytes"].max())
    loss = LossCost(0.5, 1.0, 1, held_bytes=big, peak_bytes=2 * big) if seed % 4 >= 2 else None
    transfer = Transfer(0.01, math.inf, 0.5) if seed % 2 else None  # measured: the ranks' runtime
    prof = dataclasses.replace(prof, corrections=dataclasses.replace(prof.corrections, loss=loss, transfer=transfer))
    return (LayerCosts.from_profile(prof),
            LayerCosts.from_profile(dataclasses.replace(prof, df=prof.df.drop(columns=["bwd_working_bytes"]))))


def with_buffers(seed: int, n: int, *, split: bool = False) -> tuple[LayerCosts, LayerCosts]:
    """A random chain on ranks whose cuts are as large as its saves, each layer saving part of
    its input, so that the receive buffers and what they alias decide its peak; and the same
    profile in one process, where nothing is received ([Note: receive buffers])."""
    rng = np.random.default_rng(seed + 2000)
    prof = random_chain(n, seed, split=split)
    prof.df["output_bytes"] = (prof.df["saved_bytes"] * rng.uniform(1, 4, n)).astype("int64")
    previous = np.concatenate([[0], prof.df["output_bytes"].to_numpy()[:-1]])
    prof.df["saved_input_bytes"] = (previous * rng.uniform(0, 1, n)).astype("int64")
    prof.df["saved_bytes"] = prof.df["saved_bytes"] + prof.df["saved_input_bytes"]
    prof.df["bwd_working_bytes"] = (prof.df["saved_bytes"] * rng.uniform(0, 1, n)).astype("int64")
    # the model returns some layers' outputs (a last stage receives those made before it)
    prof.df["returned_bytes"] = (prof.df["output_bytes"] * (rng.uniform(0, 1, n) < 0.4)).astype("int64")
    prof = dataclasses.replace(prof, corrections=dataclasses.replace(
        prof.corrections, transfer=Transfer(0.01, math.inf, 0.5),  # measured: the ranks' runtime
        loss=LossCost(0.5, 1.0, 1, held_bytes=int(prof.df["saved_bytes"].max()),
                      peak_bytes=2 * int(prof.df["saved_bytes"].max()))))
    return LayerCosts.from_profile(prof), LayerCosts.from_profile(prof, runtime="gpipe")
