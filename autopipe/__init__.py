"""autopipe: GPipe done automatically.

    graph = autopipe.trace(model, (x,))            # model -> LayerGraph
    prof = autopipe.profile(model, (x,))           # LayerGraph -> Profile (measured)
    plan = autopipe.partition(prof, stages=4)      # Profile -> Plan (balanced stages)
    pipe = autopipe.pipeline(model, (x,), devices=["cuda:0", "cuda:1"], plan=plan)

Dependencies run one way: graph -> profiler -> partition -> plan -> build; the runtime lives in
the separate ``executor`` package, which imports torch only.

[Note: lazy package] Public names are resolved on first use (PEP 562 ``__getattr__``), so that
``import autopipe.partition`` (and the profile, cost, plan and simulate modules) works on a
machine without torch: only the names that need torch import it. To add a public name, add it to
``_LAZY`` (name -> module), to ``__all__`` and to the ``TYPE_CHECKING`` block.
"""

from __future__ import annotations

import importlib
import sys
import types
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
    from autopipe.api import pipeline
    from autopipe.build import build
    from autopipe.cost import DeviceSpec
    from autopipe.distributed import distributed_pipeline, merge_state_dicts
    from autopipe.examples import EXAMPLES, get_example
    from autopipe.graph import LayerGraph, trace
    from autopipe.partition import partition
    from autopipe.plan import Plan
    from autopipe.plot import compare_plans, plot_balance, plot_profile, plot_timeline
    from autopipe.profile import Profile
    from autopipe.profiler import profile
    from autopipe.simulate import simulate

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
    "trace": "autopipe.graph",
    "LayerGraph": "autopipe.graph",
    "build": "autopipe.build",
    "pipeline": "autopipe.api",
    "distributed_pipeline": "autopipe.distributed",
    "merge_state_dicts": "autopipe.distributed",
    "Profile": "autopipe.profile",
    "profile": "autopipe.profiler",
    "partition": "autopipe.partition",
    "Plan": "autopipe.plan",
    "simulate": "autopipe.simulate",
    "DeviceSpec": "autopipe.cost",
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


class _Package(types.ModuleType):
    """[Note: functions named like submodules] The public functions ``autopipe.profile``,
    ``autopipe.partition``, ``autopipe.simulate`` and ``autopipe.build`` share their names with
    the submodules that define the pipeline's stages (profile.py holds the Profile value,
    partition/ the solvers, simulate.py and build.py the functions themselves), as DESIGN.md lays
    them out. Importing a submodule makes Python set it as an attribute of its package, which
    would shadow the public function after any ``from autopipe.profile import Profile``. This
    class ignores exactly that assignment for names in ``_LAZY``: submodules stay importable with
    ``from autopipe.X import Y`` and the public name stays the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
