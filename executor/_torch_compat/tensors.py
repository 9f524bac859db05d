"""Private torch names for tensors and tracing: pytree, FakeTensorMode, TorchDispatchMode, _BatchNorm,
symbolic sizes.

One part of executor._torch_compat: see [Note: private torch API] in its __init__.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)

__all__ = ["BatchNormBase", "FakeTensorMode", "TorchDispatchMode", "TreeSpec", "tree_flatten", "tree_leaves", "tree_map_only", "tree_unflatten", "symbol_source", "fake_dispatch_cache_off"]

BatchNormBase = _BatchNorm


def symbol_source(name: str) -> Any:
    """A name for a symbolic size (``torch._dynamo.source.ConstantSource``), as fake tensors with
    symbolic sizes need one (executor/ranks/symbolic.py); imported here, lazily: dynamo is heavy."""
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def fake_dispatch_cache_off() -> contextlib.AbstractContextManager[Any]:
    """A context in which new FakeTensorModes have no dispatch cache (restored on exit)."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "fake_tensor_cache_enabled"):
        return contextlib.nullcontext()
    return dynamo_config.patch(fake_tensor_cache_enabled=False)  # type: ignore[no-any-return]
