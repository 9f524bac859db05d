"""Where no stage mode fits: every repeated block recomputed alone, as its own segment.

[Note: blocks recomputed alone] The search ([Note: automatic search] in search.py) weighs each
stage recomputing whole (``never`` / ``except_last`` / ``always``) and, afterwards, a few layers
recomputed alone in stages that already fit (layer_recompute.py). A stage of a large model can
fit in none of them: recomputed whole, all of its saves are alive again at once in its backward
(a 405B stage: 125 GiB). Torchtitan's "full activation checkpointing" is one checkpoint per
transformer block: one block's saves alive again at a time, each block keeping a copy of its
input per micro-batch in flight. That is a plan of mode ``never`` whose ``recompute_layers``
are every block's layers, each block a segment of its own (``segment_starts``, [Note:
recomputed layers] in autopipe/core/recomputed_layers.py).

The blocks are the model's stack of identical modules as the profile names its layers
(:func:`repeated_blocks`): the module path with a numbered member that most layers share
(``model.layers.7.mlp.up_proj``: block 7 of ``model.layers``; ``h3.attn``: block 3 of ``h``),
each block as long as the first (a block's functional layers, ``mul_5``, ``add_8``, carry no
module path and belong to the block they sit in). A profile without such a stack gets none, and
this pass does nothing.

For a configuration where the per-stage DP found no split that fits, :func:`block_splits`
tries a few splits: the DP's fastest ignoring memory with every stage in mode ``never`` and in
mode ``always`` (whose times carry a second forward, as recomputing every block does), and
equal block counts per stage. On each, every block of every stage is recomputed alone; a stage
that then fits keeps its LAST blocks unrecomputed, as many as still fit (bisected: a backward
frees a kept block's saves before the recomputed blocks before it come alive again, so kept
last they add least to the peak). Every byte and millisecond is ``stage_costs``'; the search
then simulates each as any other split. None of these splits is proven the best one: the plan
says so (``plan.solver``'s status, and its gap to the bound of the whole space).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopipe.core.cost import DeviceSpec, LayerCosts, StageCost, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.units import format_bytes
from autopipe.solvers.stage_dp import StageBlocks, solve_split

__all__ = ["BlockSplit", "block_splits", "fit_blocks", "least_alone", "repeated_blocks", "with_blocks"]

_MEMBER = re.compile(r"^(.*?)(\d+)$")  # a numbered member of a module path: "7" of "layers.7", "h3"


def _block_of(name: str) -> tuple[str, int] | None:
    """The (stack, index) of the first numbered member in ``name``'s module path, if any."""
    parts = name.split(".")
    for depth, part in enumerate(parts[:-1]):  # the last part names the layer itself
        found = _MEMBER.match(part)
        if found:
            return ".".join([*parts[:depth], found.group(1)]), int(found.group(2))
    return None


def repeated_blocks(names: Sequence[str]) -> list[list[int]]:
    """The layer indices of each block of the profile's stack of repeated modules, in order
    ([Note: blocks recomputed alone]); [] when no stack of two or more blocks is named."""
    where = [_block_of(n) for n in names]
    stacks = Counter(w[0] for w in where if w is not None)
    if not stacks:
        return []
    stack = stacks.most_common(1)[0][0]
    first: dict[int, int] = {}
    for i, w in enumerate(where):
        if w is not None and w[0] == stack:
            first.setdefault(w[1], i)
    order = sorted(first.values())
    if len(order) < 2:
        return []
    length = order[1] - order[0]
    blocks = []
    for b, start in enumerate(order):
        end = order[b + 1] if b + 1 < len(order) else min(start + length, len(names))
        # a block ends where the next begins, or (the last) where a layer of another module path
        # comes first: the model's own layers after the stack (its final norm) are no block's
        span = list(range(start, end))
        cut = next((j for j, i in enumerate(span) if where[i] is not None and where[i] != where[start]
                    and "." in names[i]), None)
        blocks.append(span if cut is None else span[:cut])
    return blocks


def _parts(assignment: Sequence[int], blocks: Sequence[Sequence[int]], k: int) -> list[list[list[int]]]:
    """Each stage's blocks, in order: a block cut by a stage boundary is a part in each of its stages."""
    parts: list[list[list[int]]] = [[] for _ in range(k)]
    for block in blocks:
        for s in sorted({assignment[i] for i in block}):
            parts[s].append([i for i in block if assignment[i] == s])
    return parts


def with_blocks(costs: LayerCosts, assignment: Sequence[int], blocks: Sequence[Sequence[int]],
                kept: Sequence[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``recompute_layers`` and ``segment_starts`` for every block (the part of a block in each
    stage) recomputed alone, but the last ``kept[s]`` of stage s."""
    parts = _parts(assignment, blocks, len(kept))
    chosen = [p for s, ps in enumerate(parts) for p in ps[:len(ps) - kept[s]]]
    return (tuple(costs.names[i] for p in chosen for i in p), tuple(costs.names[p[0]] for p in chosen))


@dataclass(frozen=True)
class BlockSplit:
    """A split with blocks recomputed alone, and its stages' costs."""

    assignment: list[int]
    layers: tuple[str, ...]  # recompute_layers
    starts: tuple[str, ...]  # segment_starts
    stages: list[StageCost]


def _fits(stages: Sequence[StageCost], budgets: Sequence[DeviceSpec]) -> list[bool]:
    return [d.memory is None or st.memory_bytes <= d.memory for st, d in zip(stages, budgets, strict=True)]


def fit_blocks(costs: LayerCosts, devices: Sequence[DeviceSpec], budgets: Sequence[DeviceSpec],
               options: CostOptions, assignment: list[int], blocks: Sequence[Sequence[int]]) -> BlockSplit | None:
    """``assignment`` with every block recomputed alone, then each stage's last blocks kept as
    far as its budget allows; None when a stage does not fit even with all of them recomputed."""
    k = len(devices)
    never = replace(options, recompute=("never",) * k)
    most = [len(ps) for ps in _parts(assignment, blocks, k)]  # blocks (parts of blocks) per stage

    def costs_with(kept: Sequence[int]) -> tuple[tuple[str, ...], tuple[str, ...], list[StageCost]]:
        layers, starts = with_blocks(costs, assignment, blocks, kept)
        return layers, starts, stage_costs(costs, assignment, devices,
                                           replace(never, recompute_layers=layers, segment_starts=starts))

    low, high = [0] * k, list(most)  # kept blocks: low fits, high + 1 does not (bisected per stage)
    _, _, stages = costs_with(low)
    if not all(_fits(stages, budgets)):
        return None
    fits = _fits(costs_with(high)[2], budgets)
    low = [h if f else 0 for h, f in zip(high, fits, strict=True)]
    high = [h if f else h - 1 for h, f in zip(high, fits, strict=True)]
    while any(lo < hi for lo, hi in zip(low, high, strict=True)):
        mid = [(lo + hi + 1) // 2 for lo, hi in zip(low, high, strict=True)]
        fits = _fits(costs_with(mid)[2], budgets)  # each stage's memory is its own: bisected together
        low = [m if f else lo for m, lo, f in zip(mid, low, fits, strict=True)]
        high = [hi if f else m - 1 for m, hi, f in zip(mid, high, fits, strict=True)]
    layers, starts, stages = costs_with(low)
    return BlockSplit(assignment, layers, starts, stages)


def _equal_blocks(n: int, blocks: Sequence[Sequence[int]], k: int) -> list[int] | None:
    """Stages of equal block counts (the layers before the first block on the first stage, those
    after the last on the last), or None with fewer blocks than stages."""
    if len(blocks) < k:
        return None
    cuts = [0] + [blocks[round(s * len(blocks) / k)][0] for s in range(1, k)] + [n]
    return [s for s in range(k) for _ in range(cuts[s], cuts[s + 1])]


def _candidates(costs: LayerCosts, budgets: Sequence[DeviceSpec], options: CostOptions,
                blocks: Sequence[Sequence[int]], stage_blocks: StageBlocks | None) -> list[list[int]]:
    """The splits tried: the DP's fastest ignoring memory in modes always and never, equal blocks."""
    free = [DeviceSpec(d.name, None, d.speed) for d in budgets]
    out: list[list[int]] = []
    for mode in ("always", "never"):
        split = solve_split(costs, free, replace(options, recompute=mode), modes=mode, blocks=stage_blocks)
        if split is not None and split.assignment not in out:
            out.append(split.assignment)
    equal = _equal_blocks(len(costs), blocks, len(budgets))
    return out + ([equal] if equal is not None and equal not in out else [])


def least_alone(costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> str:
    """For an error: the least memory a stage needs with every block recomputed alone, on the
    splits tried (not a proven least), as a clause; "" without repeated blocks."""
    blocks = repeated_blocks(costs.names)
    if not blocks:
        return ""
    k = len(devices)
    opts = replace(options, recompute=("never",) * k)
    least = min(max(st.memory_bytes for st in stage_costs(costs, a, devices, replace(
        opts, recompute_layers=layers, segment_starts=starts)))
        for a in _candidates(costs, devices, options, blocks, None)
        for layers, starts in [with_blocks(costs, a, blocks, [0] * k)])
    return f"; with every repeated block recomputed alone, {format_bytes(least)} on the splits tried"


def block_splits(costs: LayerCosts, devices: Sequence[DeviceSpec], budgets: Sequence[DeviceSpec],
                 options: CostOptions, stage_blocks: StageBlocks | None = None) -> list[BlockSplit]:
    """The splits of [Note: blocks recomputed alone] that fit, each with the profile's repeated
    blocks recomputed alone; [] without such blocks."""
    blocks = repeated_blocks(costs.names)
    if not blocks:
        return []
    out: list[BlockSplit] = []
    for assignment in _candidates(costs, budgets, options, blocks, stage_blocks):
        found = fit_blocks(costs, devices, budgets, options, assignment, blocks)
        if found is not None:
            out.append(found)
    return out
