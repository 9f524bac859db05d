"""autopipe: GPipe done automatically.

    graph = autopipe.trace(model, (x,))            # model -> LayerGraph
    prof = autopipe.profile(model, (x,))           # LayerGraph -> Profile (measured)
    plan = autopipe.partition(prof, stages=4)      # Profile -> Plan (balanced stages)
    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"], plan=plan)

The packages, in the order data flows through them (docs/DESIGN.md has the map and the rules):

    core/        torch-free values, one cost model: Profile, Plan, simulator, units, atomic files
    solvers/     torch-free: partition() with the exact DP, the ILP and the baselines
    frontend/    torch: trace a model, group layers, profile them, cut stage modules
    assemble/    pipeline() and distributed_pipeline(): frontend + solvers + executor
    plot/        matplotlib figures of plans, profiles and timelines
    app/         the command line and what it runs (no library logic)

and two modules beside them:

    errors.py    AutopipeError and its subclasses: the one-line errors of every public entry point
    examples.py  the bundled example models (``autopipe profile mlp``): inputs, target and loss

The runtime is the separate ``executor`` package, which never imports ``autopipe``.

[Note: lazy package] Public names are resolved on first use (PEP 562 ``__getattr__``), so that
``import autopipe`` and the planner (``autopipe.partition`` on a saved profile) work on a machine
without torch: only the names that need torch import it. No public name is also the name of a
submodule, so importing any submodule never shadows a public function. To add a public name, add
it to ``_LAZY`` (name -> module), to ``__all__`` and to the ``TYPE_CHECKING`` block. Inside, too,
what only some paths need is imported where it is used (the profiler in ``pipeline()``, pandas
where a profile table is built or read): ``autopipe run``'s ranks build from a plan and load
neither pandas, PuLP nor matplotlib (tests/test_layering.py), a third of a second each.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autopipe.errors import (
    AutopipeError,
    BuildError,
    PartitionError,
    PlanError,
    PlotError,
    ProfileError,
    TraceError,
)

if TYPE_CHECKING:  # real imports for type checkers; at run time see __getattr__
    from autopipe.assemble.local import pipeline
    from autopipe.assemble.rank_parts import merge_state_dicts
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.devices import DeviceSpec
    from autopipe.core.plan import Plan
    from autopipe.core.profile_table import Profile
    from autopipe.core.simulator import simulate
    from autopipe.examples import EXAMPLES, get_example
    from autopipe.frontend.building.stages import build
    from autopipe.frontend.profiling.profiler import profile
    from autopipe.frontend.tracing.graph import LayerGraph, trace
    from autopipe.plot import compare_plans, plot_balance, plot_profile, plot_timeline
    from autopipe.solvers.partitioner import partition
    from executor.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint

__all__ = [
    "AutopipeError",
    "BuildError",
    "PartitionError",
    "PlanError",
    "PlotError",
    "ProfileError",
    "TraceError",
    "EXAMPLES",
    "get_example",
    "trace",
    "LayerGraph",
    "build",
    "pipeline",
    "distributed_pipeline",
    "merge_state_dicts",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_info",
    "Profile",
    "profile",
    "partition",
    "Plan",
    "simulate",
    "DeviceSpec",
    "plot_balance",
    "plot_profile",
    "plot_timeline",
    "compare_plans",
]

# public name -> module that defines it (imported on first attribute access)
_LAZY: dict[str, str] = {
    "EXAMPLES": "autopipe.examples",
    "get_example": "autopipe.examples",
    "trace": "autopipe.frontend.tracing.graph",
    "LayerGraph": "autopipe.frontend.tracing.graph",
    "build": "autopipe.frontend.building.stages",
    "pipeline": "autopipe.assemble.local",
    "distributed_pipeline": "autopipe.assemble.ranks",
    "merge_state_dicts": "autopipe.assemble.rank_parts",
    "save_checkpoint": "executor.checkpoint",
    "load_checkpoint": "executor.checkpoint",
    "checkpoint_info": "executor.checkpoint",
    "Profile": "autopipe.core.profile_table",
    "profile": "autopipe.frontend.profiling.profiler",
    "partition": "autopipe.solvers.partitioner",
    "Plan": "autopipe.core.plan",
    "simulate": "autopipe.core.simulator",
    "DeviceSpec": "autopipe.core.devices",
    "plot_balance": "autopipe.plot",
    "plot_profile": "autopipe.plot",
    "plot_timeline": "autopipe.plot",
    "compare_plans": "autopipe.plot",
}

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups bypass __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
