"""A distributed pipeline rank's state under the original model's keys: its ``state_dict`` part
and its share of a checkpoint.

[Note: checkpoint parts] ``DistributedPipeline.state_dict()``'s keys are exactly what
``model.state_dict()`` has for the tensors this rank holds (a tie: every key). Which part of
which pipeline this is (rank, world, stage indices, number of stages, steps taken) rides outside
the keys, in the dict's ``_metadata`` under ``PART_METADATA``, where torch keeps its own
per-module versions (``torch.save`` keeps it, ``load_state_dict`` ignores it), so that merging
the parts (autopipe.merge_state_dicts) can name a missing rank or a part of another pipeline. A
checkpoint (executor/checkpoint/) is keyed the same way, through :func:`rank_checkpoint_view`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from executor.checkpoint import CheckpointView

__all__ = ["PART_METADATA", "rank_state_dict", "rank_checkpoint_view"]

PART_METADATA = "autopipe:part"


def rank_state_dict(pipe: Any) -> dict[str, Any]:
    """``pipe``'s (a DistributedPipeline's) part, see [Note: checkpoint parts]; a tensor split
    over ranks (a DTensor: tensor parallelism, FSDP) gathered whole, a collective of its group."""
    out: OrderedDict[str, Any] = OrderedDict()
    for stage in pipe.stages:
        for key, value in stage.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            for alias in pipe.key_aliases.get(key, [key]):
                out[alias] = value
    out._metadata = OrderedDict({PART_METADATA: {  # type: ignore[attr-defined]
        "rank": pipe.rank, "world": pipe.world, "stages": list(pipe.indices),
        "num_stages": pipe.num_stages, "steps": pipe.steps}})
    return out


def rank_checkpoint_view(pipe: Any) -> CheckpointView:
    """This rank's tensors (FSDP's: the sharded DTensors its optimizer holds) under all their
    original names, as a rank of the default group; a tensor two of its stages share (the V
    schedules' tied first and last stage) once."""
    by_id: dict[int, tuple[Tensor, list[str]]] = {}  # a tensor two of its stages share: once
    for stage in pipe.stages:
        for key, tensor in stage.state_dict(keep_vars=True).items():
            held = by_id.setdefault(id(tensor), (tensor, []))[1]
            held += [a for a in pipe.key_aliases.get(key, [key]) if a not in held]
    names = list(by_id.values())
    about = {"runtime": "distributed", "num_stages": pipe.num_stages, "schedule": pipe.schedule_name,
             "chunks": pipe.chunks, "pipeline_ranks": pipe.pp_size, "data_parallel": pipe.dp_size,
             "dp_mode": getattr(pipe, "dp_mode", None)}
    return CheckpointView(names=names, rank=dist.get_rank(), world=dist.get_world_size(), distributed=True,
                          devices=[pipe.device], about=about)
