"""executor: the GPipe runtime. Knows stages, devices and micro-batches; never the planner.

Imports torch only (never ``autopipe``), so it can be used with hand-made stages.

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
    from executor.batchnorm import DeferredBatchNorm
    from executor.distributed import DistributedPipeline, PipelineFailure
    from executor.errors import DistributedError, ExecutorError, MicroBatchError, PlacementError
    from executor.fill_drain import clock_cycles
    from executor.gpipe import GPipe
    from executor.microbatch import gather, scatter
    from executor.rank_cores import pin_local_rank
    from executor.recompute import is_checkpointing, is_recomputing
    from executor.replicated import ReplicatedPipeline, pipeline_mesh
    from executor.timeline import save_chrome_trace, to_chrome_trace

__all__: list[str] = [
    "GPipe",
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
    "GPipe": "executor.gpipe",
    "save_chrome_trace": "executor.timeline",
    "to_chrome_trace": "executor.timeline",
    "DeferredBatchNorm": "executor.batchnorm",
    "clock_cycles": "executor.fill_drain",
    "scatter": "executor.microbatch",
    "gather": "executor.microbatch",
    "is_checkpointing": "executor.recompute",
    "is_recomputing": "executor.recompute",
    "ExecutorError": "executor.errors",
    "MicroBatchError": "executor.errors",
    "PlacementError": "executor.errors",
    "DistributedError": "executor.errors",
    "DistributedPipeline": "executor.distributed",
    "PipelineFailure": "executor.distributed",
    "ReplicatedPipeline": "executor.replicated",
    "pipeline_mesh": "executor.replicated",
    "pin_local_rank": "executor.rank_cores",
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
