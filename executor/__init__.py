"""executor: the pipeline runtimes. Know stages, devices, ranks and micro-batches; never the planner.

Imports torch only (never ``autopipe``), so it can be used with hand-made stages.

Sub-packages, one runtime each, and what they share:
    local/        GPipe in one process over several devices (executor.GPipe)
    ranks/        one rank's stages on torch.distributed.pipelining (executor.DistributedPipeline,
                  ReplicatedPipeline)
    checkpoint/   saved training state (DCP) that loads under any plan
    spec            the torch-free rules the planner and both runtimes agree on
    decision        what a plan decides, as one frozen value both runtimes take (torch-free)
    microbatch      scatter a mini-batch, gather the micro-batches' outputs
    packed          one packed row cut at sequence starts (padded rows on ranks), joined back
    recompute       activation recomputation and the autograd plumbing that orders it
    precision       autocast inside every stage
    keywords        keyword inputs bound in the stages' order
    model_loss      a loss the model computes, weighted per micro-batch
    grad_norm       the gradient norm over devices, ranks and replicas, and clipping by it
    host_allocator  freed host memory kept in the process, as CUDA's allocator does
    activation_meter  the bytes autograd keeps for backward, per stage
    memory_meter    every live tensor storage and its peak, as a GPU allocator reports it
    errors          one-line ValueError subclasses
    _torch_compat/  every private torch API, each checked before use (tensors, schedules, groups)

[Note: lazy executor] Public names are resolved on first use (PEP 562 ``__getattr__``), so that
``import executor.spec`` (the torch-free rules the planner shares with the runtime) does not
import torch, and ``import executor`` does not pay for torch.distributed.pipelining until a
distributed name is used. To add a public name, add it to ``_LAZY``, ``__all__`` and the
``TYPE_CHECKING`` block.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from executor.spec import TimelineEvent

if TYPE_CHECKING:
    from executor.decision import Decision
    from executor.errors import DistributedError, ExecutorError, MicroBatchError, PlacementError
    from executor.local.batchnorm import DeferredBatchNorm
    from executor.local.fill_drain import clock_cycles
    from executor.local.gpipe import GPipe
    from executor.local.timeline import save_chrome_trace, to_chrome_trace
    from executor.microbatch import gather, scatter
    from executor.ranks.distributed import DistributedPipeline, PipelineFailure
    from executor.ranks.rank_cores import pin_local_rank
    from executor.ranks.replicated import ReplicatedPipeline, pipeline_mesh
    from executor.recompute import is_checkpointing, is_recomputing

__all__: list[str] = [
    "GPipe",
    "Decision",
    "TimelineEvent",
    "save_chrome_trace",
    "to_chrome_trace",
    "DeferredBatchNorm",
    "clock_cycles",
    "scatter",
    "gather",
    "is_checkpointing",
    "is_recomputing",
    "ExecutorError",
    "MicroBatchError",
    "PlacementError",
    "DistributedPipeline",
    "ReplicatedPipeline",
    "pipeline_mesh",
    "DistributedError",
    "PipelineFailure",
    "pin_local_rank",
]

# public name -> module that defines it (imported on first attribute access)
_LAZY: dict[str, str] = {
    "GPipe": "executor.local.gpipe",
    "Decision": "executor.decision",
    "save_chrome_trace": "executor.local.timeline",
    "to_chrome_trace": "executor.local.timeline",
    "DeferredBatchNorm": "executor.local.batchnorm",
    "clock_cycles": "executor.local.fill_drain",
    "scatter": "executor.microbatch",
    "gather": "executor.microbatch",
    "is_checkpointing": "executor.recompute",
    "is_recomputing": "executor.recompute",
    "ExecutorError": "executor.errors",
    "MicroBatchError": "executor.errors",
    "PlacementError": "executor.errors",
    "DistributedError": "executor.errors",
    "DistributedPipeline": "executor.ranks.distributed",
    "PipelineFailure": "executor.ranks.distributed",
    "ReplicatedPipeline": "executor.ranks.replicated",
    "pipeline_mesh": "executor.ranks.replicated",
    "pin_local_rank": "executor.ranks.rank_cores",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'executor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups bypass __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
