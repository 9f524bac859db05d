"""Parameters that stages on several ranks share (a tied embedding and LM head), rank by rank.

    ties = rank_ties(stages, mine, schedule, ranks)   # [(ranks holding it, this rank's copy)]
    check_fsdp_layout(stages, schedule, ranks)        # FSDP2 cannot shard a tie within a rank
    DistributedPipeline(..., ties=ties)               # each step: sum_tied_grads(ties, before)

Every rank builds every stage module from the plan (cheap: the modules share the model's
parameters), so each can work out, without a collective, which ranks hold each parameter under
the schedule's stage-to-rank layout ([Note: stage to rank] in executor/spec.py). A parameter
held by more than one rank is a tie: its gradient is summed over those ranks after each
backward (executor.ranks.distributed). A tie between two stages of one rank (the V schedules'
first and last stage) is no tie: autograd sums it in place.

[Note: tied parameters across ranks] A Parameter used by stages on different ranks (a GPT's
tied embedding and head) exists once per rank. After each step the owners all-reduce (sum) its
gradient on a group of just those ranks (:func:`sum_tied_grads`), so every copy holds the full
gradient and identical optimizer steps keep the copies equal. Replicas of a pipeline
(executor/ranks/replicated.py) pass each tie's group of their own replica, and an FSDP-sharded
copy all-reduces its local shard (the copies are sharded alike across replicas, so shard i meets
shard i). Only this step's gradient is summed ([Note: a step adds its own gradients] in
executor/ranks/distributed.py): :func:`tied_grads` keeps what earlier steps left, which every
copy already holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from executor.errors import DistributedError
from executor.spec import stage_rank

__all__ = ["rank_ties", "check_fsdp_layout", "check_fsdp_ties", "tied_grads", "sum_tied_grads"]

Tie = tuple[dist.ProcessGroup | None, nn.Parameter | None]  # (its ranks' group, this rank's copy)


def rank_ties(stages: Sequence[nn.Module], mine: Sequence[int], schedule: str,
              ranks: int) -> list[tuple[list[int], nn.Parameter | None]]:
    """Each parameter held by stages on more than one of the ``ranks`` pipeline ranks: the ranks
    that hold it, and the Parameter if one of this rank's stages (``mine``) holds it, else None."""
    owners: dict[int, list[int]] = {}
    for i, stage in enumerate(stages):
        held_by = stage_rank(schedule, i, ranks)
        for p in stage.parameters():
            held = owners.setdefault(id(p), [])
            if held_by not in held:  # a tie within one rank is no tie
                held.append(held_by)
    local = {id(p): p for i in mine for p in stages[i].parameters()}
    return [(held, local.get(pid)) for pid, held in owners.items() if len(held) > 1]


def check_fsdp_layout(stages: Sequence[nn.Module], schedule: str, ranks: int) -> None:
    """:func:`check_fsdp_ties` for every rank's stages, on every rank before any builds its
    replica, so all of them raise the same one-line DistributedError."""
    for r in range(ranks):
        held = [i for i in range(len(stages)) if stage_rank(schedule, i, ranks) == r]
        check_fsdp_ties([stages[i] for i in held], held, schedule)



def check_fsdp_ties(stages: Sequence[nn.Module], indices: Sequence[int], schedule: str) -> None:
    """FSDP2 shards each stage on its own, so two stages of one rank cannot share a parameter
    (the V schedules' first and last stage, a tied embedding and head): one line saying so.
    Raised on the rank that holds them; autopipe.distributed_pipeline checks every rank's."""
    seen: dict[int, tuple[int, str]] = {}
    for stage, index in zip(stages, indices, strict=True):
        for name, p in stage.named_parameters():
            if id(p) in seen and seen[id(p)][0] != index:
                first, other = seen[id(p)]
                raise DistributedError(
                    f"dp_mode='fsdp' shards each stage on its own, but stages {first} and {index} on "
                    f"this rank share the parameter {other!r} (a tie; schedule={schedule!r} runs both "
                    "here): use dp_mode='ddp', or a schedule that puts them on different ranks "
                    "('interleaved_zb', 'interleaved1f1b')")
            seen.setdefault(id(p), (index, name))


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def tied_grads(ties: Sequence[Tie]) -> list[Tensor | None]:
    """Each tied parameter's gradient before a step (None where it has none)."""
    return [None if tied is None or tied.grad is None else _local(tied.grad).clone()
            for _, tied in ties]


def sum_tied_grads(ties: Sequence[Tie], before: Sequence[Tensor | None] = ()) -> None:
    """Sum this step's gradient of each tied parameter over its copies on other ranks; ``before``:
    :func:`tied_grads` from before the step (nothing before it: the whole gradient)."""
    for k, (group, tied) in enumerate(ties):
        if tied is None:
            continue
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        grad = _local(tied.grad)
        earlier = before[k] if k < len(before) else None
        if earlier is not None:
            grad.sub_(earlier)
        dist.all_reduce(grad, group=group)
        if earlier is not None:
            grad.add_(earlier)
