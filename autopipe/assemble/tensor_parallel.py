"""distributed_pipeline(plan=) with ``plan.tensor_parallel = t > 1``: the checks, the (dp, pp, tp)
mesh and each rank's stages split over its TP group.

[Note: tensor parallelism on ranks] (autopipe/frontend/building/tensor_parallel.py) rewrites the
stages; [Note: the (dp, pp, tp) mesh] (executor/ranks/tensor_parallel.py) lays out the ranks as
the plan does. Every refusal here is one BuildError line, raised on every rank alike before any
collective (each rank traced the same model).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from autopipe.core.plan import Plan
from autopipe.core.tensor_parallel import (
    COLUMN,
    SHARDED,
    VOCAB_EMBEDDING,
    VOCAB_GROUP,
    degree_refusal,
)
from autopipe.errors import BuildError
from autopipe.frontend.building.stages import RecomputedLayer
from autopipe.frontend.building.tensor_parallel import shard_stage
from autopipe.frontend.tracing.graph import LayerGraph
from autopipe.frontend.tracing.tensor_parallel import tensor_parallel_nodes
from executor.ranks.tensor_parallel import TensorParallelOps, tensor_parallel_mesh, tokens_error
from executor.ranks.watchdog import StepLimits
from executor.ranks.wire import Wire

__all__ = ["degree_of", "check_world", "check_replicas", "TensorParallelRoles", "roles_of", "check_cuts", "split_stages", "mesh_of",
           "split_ties", "split_wires"]


def degree_of(plan: Plan | None) -> int:
    return 1 if plan is None else plan.tensor_parallel


def check_world(degree: int, world: int) -> None:
    """The world splits into TP groups of ``degree`` ranks, each inside one host."""
    if world % degree:
        raise BuildError(f"the plan splits each stage over tensor_parallel={degree} ranks but the world has "
                         f"{world}; start PP x TP x DP ranks (a multiple of {degree})")
    host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if host % degree:
        raise BuildError(f"tensor_parallel={degree} would span hosts of {host} ranks (LOCAL_WORLD_SIZE): a TP "
                         f"group all-reduces in every layer and stays inside one host; make the plan with "
                         f"a degree that divides {host} (`autopipe partition --devices-per-host {host}`)")


def check_replicas(degree: int, replicas: int, dp_mode: str) -> None:
    """Replicas of a TP pipeline share gradients under FSDP2 only (DDP takes no DTensor)."""
    if degree > 1 and replicas > 1 and dp_mode != "fsdp":
        raise BuildError(f"tensor_parallel={degree} with data_parallel={replicas} runs under dp_mode='fsdp' "
                         f"only (DDP does not take the split parameters); use dp_mode='fsdp' "
                         f"(`autopipe partition --dp-mode fsdp`)")


@dataclass(frozen=True)
class TensorParallelRoles:
    """Per fx node its (role, group); whether the degree splits the vocabulary."""

    nodes: dict[str, tuple[str, str]]
    vocab: bool
    tokens: frozenset[str] = frozenset()  # split by tokens under sequence parallelism, else empty


def roles_of(graph: LayerGraph, degree: int, sequence: bool = False) -> TensorParallelRoles:
    """What the trace says to split at ``degree`` (by tokens too where ``sequence``), or one line
    for a model it cannot split so."""
    structure, nodes = tensor_parallel_nodes(graph.gm, graph.node_layer, graph.layers)
    line = degree_refusal(structure.groups, degree)  # the planner's rule, on the traced graph
    if line:
        raise BuildError(line)
    vocab = structure.groups.get(VOCAB_GROUP, 0)
    if sequence:  # [Note: sequence parallelism on ranks]
        _check_tokens(graph, structure.tokens, degree)
    return TensorParallelRoles(nodes, bool(vocab) and vocab % degree == 0,
                               structure.tokens if sequence else frozenset())


def _check_tokens(graph: LayerGraph, tokens: frozenset[str], degree: int) -> None:
    """The example's tokens (each split value's second-to-last size) divide by the degree."""
    for node in graph.gm.graph.nodes:
        val = node.meta.get("val") if node.name in tokens else None
        if isinstance(val, torch.Tensor) and val.shape[-2] % degree:
            raise BuildError(tokens_error(int(val.shape[-2]), degree))


def check_cuts(stages: Sequence[fx.GraphModule], roles: TensorParallelRoles) -> None:
    """No cut between stages, and no segment of layers recomputed alone, may carry a value a group
    splits (between its columns and its row): a segment is rewritten on its own, as a stage is."""
    def split(node: Any) -> tuple[str, str] | None:
        role = roles.nodes.get(node.name, ("", "")) if isinstance(node, fx.Node) else ("", "")
        return role if role[0] in (COLUMN, SHARDED) else None

    for i, stage in enumerate(stages):
        for node in stage.graph.nodes:
            role = split(node) if node.op == "placeholder" else None
            if role:
                raise BuildError(f"the plan cuts group {role[1]!r} between stages {i - 1} and {i} (inside the "
                                 f"tensor-parallel region, at {node.name}): move the cut before its columns or "
                                 "after its row")
        for name, segment in _segments(stage):
            ends = [n for n in segment.graph.nodes if n.op == "placeholder"]
            ends += [a for n in segment.graph.nodes if n.op == "output" for a in n.all_input_nodes]
            role = next((r for r in map(split, ends) if r), None)
            if role:
                raise BuildError(f"stage {i}'s layers recomputed alone in {name} begin or end inside group "
                                 f"{role[1]!r} (its split values would cross the segment's edge): recompute "
                                 "whole groups (a block each) or make the plan with tensor_parallel=1")


def _segments(stage: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """The segments of layers recomputed alone in ``stage`` ([Note: recomputed layers])."""
    return [(name, m.layer) for name, m in stage.named_modules() if isinstance(m, RecomputedLayer)]


def split_stages(stages: Sequence[fx.GraphModule], mine: Sequence[int], roles: TensorParallelRoles,
                 mesh: DeviceMesh) -> dict[int, nn.Parameter]:
    """This rank's stages rewritten for its TP rank; each original parameter's id -> its split.
    A rewrite one rank refuses is refused on every rank, in that rank's line (each rewrites its
    own stages: the others would wait for it in their first step)."""
    ops = TensorParallelOps(mesh)
    made: dict[int, nn.Parameter] = {}
    refused: str | None = None
    try:
        for i in mine:
            segments = _segments(stages[i])  # read before the stage's rewrite, which reads their outputs
            shard_stage(stages[i], roles.nodes, ops, vocab=roles.vocab, made=made, sequence=roles.tokens,
                        last=i == len(stages) - 1)
            for _, segment in segments:  # whole groups (check_cuts): rewritten as stages are
                shard_stage(segment, roles.nodes, ops, vocab=roles.vocab, made=made, sequence=roles.tokens,
                            last=False)
    except BuildError as err:
        refused = str(err)
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, refused)
    first = next(((r, line) for r, line in enumerate(every) if line), None)
    if first is not None:
        raise BuildError(first[1] if first[0] == dist.get_rank() else f"rank {first[0]}: {first[1]}")
    return made


def split_wires(wires: Sequence[tuple[Wire, ...]], stages: Sequence[fx.GraphModule], roles: TensorParallelRoles,
                degree: int) -> list[tuple[Wire, ...]]:
    """The wires of the cuts between stages with the values split by tokens carrying 1/``degree``
    of them ([Note: sequence parallelism on ranks]): cut i is stage i's inputs."""
    out = [tuple(cut) for cut in wires]
    for i in range(1, len(stages)):
        names = [n.name for n in stages[i].graph.nodes if n.op == "placeholder"]
        split = [n in roles.tokens and (roles.vocab or roles.nodes.get(n, ("", ""))[0] != VOCAB_EMBEDDING)
                 for n in names]
        out[i] = tuple(_split_wire(w, out[i], split, k, degree) for k, w in enumerate(out[i]))
    return out


def _split_wire(wire: Wire, cut: tuple[Wire, ...], split: list[bool], k: int, degree: int) -> Wire:
    if wire.kind == "view" and split[wire.value]:
        return dataclasses.replace(wire, kind="tensor")  # its source crosses split; it, whole
    return wire.split_tokens(degree) if split[k] and wire.kind == "tensor" else wire


def mesh_of(replicas: int, pp_size: int, degree: int, device: torch.device, timeout: float | None,
            first_step_timeout: float | None) -> DeviceMesh:
    """The (dp, pp, tp) mesh, its groups waiting as long as the first step may take."""
    limit = StepLimits(timeout, first_step_timeout).group_timeout  # [Note: the first step's own limit]
    return tensor_parallel_mesh(replicas, pp_size, degree, device=device,
                                timeout=None if limit is None else limit.total_seconds())


def split_ties(ties: Sequence[tuple[list[int], nn.Parameter | None]],
               made: dict[int, nn.Parameter]) -> list[tuple[list[int], nn.Parameter | None]]:
    """Each tie with this rank's copy as its stage now holds it (split, where the stage split it)."""
    return [(ranks, None if p is None else made.get(id(p), p)) for ranks, p in ties]
