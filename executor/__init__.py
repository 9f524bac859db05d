"""executor: the GPipe runtime. Knows stages, devices and micro-batches; never the planner.

Imports torch only (never ``autopipe``), so it can be used with hand-made stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from executor.batchnorm import DeferredBatchNorm
from executor.checkpoint import is_checkpointing, is_recomputing
from executor.errors import ExecutorError, MicroBatchError, PlacementError
from executor.gpipe import GPipe
from executor.microbatch import gather, scatter
from executor.schedule import clock_cycles
from executor.trace import TraceEvent, save_chrome_trace, to_chrome_trace

__all__: list[str] = [
    "GPipe",
    "TraceEvent",
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
    "DistributedError",
    "PipelineFailure",
]

if TYPE_CHECKING:
    from executor.distributed import DistributedError, DistributedPipeline, PipelineFailure

# executor.distributed imports torch.distributed.pipelining (about a second): load it on first use
_LAZY = {"DistributedPipeline", "DistributedError", "PipelineFailure"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'executor' has no attribute {name!r}")
    import executor.distributed

    return getattr(executor.distributed, name)
