"""torch's auto_partition, its idea written again as a peer for benchmarks/step_split.py.

torch.distributed.pipelining's ``auto_partition`` (pytorch#179212,
torch/distributed/pipelining/_partition.py; not in torch 2.13) splits a chain by a min-max DP over
each layer's forward + backward compute, transfers left out, then refines that split: it simulates
the schedule in its own simulator, finds the stage that carries most of the critical path in the
steady phase, and tries two moves of that stage (its first layer to the stage before, the layers
before it balanced again by the same DP; or its last layer to the stage after, the layers before
the moved one balanced again), keeps the fastest split it saw, and explores on from a move while
the critical stage does not move right.

Its critical stage comes from torch's own simulator's critical path, which is not autopipe's. So
here every stage's two moves are tried from every split reached, not the critical stage's alone:
the splits reached include every split torch's refinement can reach, and the fastest of them in
autopipe's simulator is at least as fast there as the one torch would return.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile

Blocks = tuple[tuple[int, int], ...]  # each stage's [first, end) layers

__all__ = ["minmax_blocks", "reachable", "fastest_reachable"]


def minmax_blocks(work: Sequence[float], parts: int, start: int = 0, end: int | None = None) -> Blocks:
    """Layers ``start:end`` in ``parts`` contiguous blocks whose largest sum of ``work`` is the
    least; among equal ones the last block starts earliest (torch's strict comparison)."""
    end = len(work) if end is None else end
    prefix = list(itertools.accumulate(work[start:end], initial=0.0))
    n = end - start
    inf = float("inf")
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    where = [[-1] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0.0
    for p in range(1, parts + 1):
        for e in range(p, n + 1):
            for s in range(p - 1, e):
                c = max(cost[p - 1][s], prefix[e] - prefix[s])
                if c < cost[p][e]:
                    cost[p][e], where[p][e] = c, s
    out, e = [], n
    for p in range(parts, 0, -1):
        s = where[p][e]
        out.append((start + s, start + e))
        e = s
    return tuple(reversed(out))


def _moves(blocks: Blocks, work: Sequence[float]) -> list[Blocks]:
    """torch's two moves of every stage that has more than one layer."""
    out = []
    for c, (first, end) in enumerate(blocks):
        if end - first < 2:
            continue
        if c > 0:  # the first layer to the stage before; the layers up to it balanced again
            out.append(minmax_blocks(work, c, 0, first + 1) + ((first + 1, end),) + blocks[c + 1:])
        if c < len(blocks) - 1:  # the last layer to the stage after; the layers before it again
            after = ((end - 1, blocks[c + 1][1]),) + blocks[c + 2:]
            out.append(minmax_blocks(work, c + 1, 0, end - 1) + after)
    return out


def reachable(work: Sequence[float], stages: int, limit: int = 20_000) -> list[Blocks]:
    """Every split torch's moves reach from its DP split (at most ``limit``), the DP's first."""
    base = minmax_blocks(work, stages)
    seen, todo = {base: None}, [base]
    while todo and len(seen) < limit:
        for nxt in _moves(todo.pop(0), work):
            if nxt not in seen:
                seen[nxt] = None
                todo.append(nxt)
    return list(seen)


def fastest_reachable(prof: Profile, like: Plan) -> tuple[Plan, Plan, int]:
    """torch's DP split and the fastest split its moves reach, as plans of ``like``'s
    configuration in autopipe's simulator, and how many splits were reached."""
    work = [f + b for f, b in zip(prof.df["fwd_ms"], prof.df["bwd_ms"], strict=True)]
    layers = prof.layers
    plans = [Plan.from_stages(prof, [layers[a:b] for a, b in blocks], devices=like.devices, chunks=like.chunks,
                              schedule=like.schedule, recompute=like.recompute, bandwidth=like.bandwidth)
             for blocks in reachable(work, like.num_stages)]
    return plans[0], min(plans, key=lambda p: p.iteration_time), len(plans)
