"""assemble: a model and a plan put together into a pipeline ready to train.

    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"])     # one process
    pipe = autopipe.distributed_pipeline(model, (x,), schedule="1f1b")      # each rank, torchrun
    state = autopipe.merge_state_dicts(["rank0.pt", "rank1.pt"])            # the ranks' parts

Modules:
    local       pipeline(): trace + profile + partition + build -> executor.GPipe
    ranks       distributed_pipeline(): the same on every rank -> executor.DistributedPipeline
    mesh        replicas of the rank pipeline on a (dp, pp) mesh -> executor.ReplicatedPipeline
    rank_parts  merge_state_dicts(): the ranks' state_dict parts as the plain model's
    pretrained  pipe.save_pretrained(): the model's config and one safetensors shard per stage
    setup       the setup the two pipelines share, written once
    from_rank0  what rank 0 works out and every rank receives: the plan, weights and wires
    tensor_parallel  a plan of tensor_parallel=t on ranks: its checks, the (dp, pp, tp) mesh, the
                split stages

Entry points resolve on first use, as autopipe's own do ([Note: lazy package] in autopipe/__init__.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopipe.assemble.local import Pipeline, pipeline
    from autopipe.assemble.rank_parts import merge_state_dicts
    from autopipe.assemble.ranks import distributed_pipeline

__all__ = ["Pipeline", "pipeline", "distributed_pipeline", "merge_state_dicts"]

_LAZY: dict[str, str] = {
    "Pipeline": "autopipe.assemble.local",
    "pipeline": "autopipe.assemble.local",
    "distributed_pipeline": "autopipe.assemble.ranks",
    "merge_state_dicts": "autopipe.assemble.rank_parts",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopipe.assemble' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
