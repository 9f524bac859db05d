"""Parameters that stages on several ranks share (a tied embedding and LM head), rank by rank.

    ties = rank_ties(stages, mine, schedule, ranks)   # [(ranks holding it, this rank's copy)]
    check_fsdp_layout(stages, schedule, ranks)        # FSDP2 cannot shard a tie within a rank
    DistributedPipeline(..., ties=ties)

Every rank builds every stage module from the plan (cheap: the modules share the model's
parameters), so each can work out, without a collective, which ranks hold each parameter under
the schedule's stage-to-rank layout ([Note: stage to rank] in executor/spec.py). A parameter
held by more than one rank is a tie: its gradient is summed over those ranks after each
backward (executor.ranks.distributed). A tie between two stages of one rank (the V schedules'
first and last stage) is no tie: autograd sums it in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from executor.ranks.replicated import check_fsdp_ties
from executor.spec import stage_rank

__all__ = ["rank_ties", "check_fsdp_layout"]


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

