"""autopipe: GPipe done automatically.

    graph = autopipe.trace(model, (x,))            # model -> LayerGraph
    prof = autopipe.profile(model, (x,))           # LayerGraph -> Profile (measured)
    plan = autopipe.partition(prof, stages=4)      # Profile -> Plan (balanced stages)
    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"], plan=plan)

Dependencies run one way: graph -> profiler -> partition -> plan -> build; the runtime lives in
the separate ``executor`` package, which imports torch only.
"""

from __future__ import annotations

from autopipe.errors import (
    AutopipeError,
    BuildError,
    PartitionError,
    PlanError,
    ProfileError,
    TraceError,
)
from autopipe.examples import EXAMPLES, get_example

__all__ = [
    "AutopipeError",
    "BuildError",
    "PartitionError",
    "PlanError",
    "ProfileError",
    "TraceError",
    "EXAMPLES",
    "get_example",
]

__version__ = "0.1.0"
