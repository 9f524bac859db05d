"""Private torch.distributed API of process groups: timeouts, peer failures, the GradScaler's flags.

One part of executor._torch_compat: see [Note: private torch API] in its __init__.py.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["is_communication_error", "mesh_group_options", "set_group_timeout", "found_inf_per_device"]

_COMMUNICATION_MARKERS = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout caused pair closure",  # gloo, a send or receive waited past the group's timeout
)


def is_communication_error(err: BaseException) -> bool:
    """True for a failure of the link to a peer (dead, silent or dropped); False for this
    rank's own errors (a shape mismatch, out of memory), which must propagate unchanged."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    text = str(err).lower()
    return any(marker in text for marker in _COMMUNICATION_MARKERS)


def mesh_group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Options giving a DeviceMesh dimension's groups ``timeout`` (see the module's docstring)."""
    kinds = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available}
    if backend not in kinds or not kinds[backend]():
        return None
    kind: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    try:
        try:
            options = kind.Options()
        except TypeError:  # gloo's is torch's Backend.Options(backend, timeout=...)
            options = kind.Options(backend)
        options._timeout = timeout
    except (AttributeError, TypeError):
        return None
    return options


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> bool:
    """Set ``group``'s timeout for its later operations; False where this torch cannot."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "only supported for nccl or gloo": False below
            _set_pg_timeout(timeout, group)
    except (RuntimeError, ValueError, AssertionError, AttributeError, TypeError):
        return False
    return True


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                         ) -> dict[torch.device, torch.Tensor]:
    """The scaler's found-inf flag per device for ``optimizer`` since its ``unscale_`` (the
    dict itself: what is changed or added in it, ``step`` and ``update`` read)."""
    method = getattr(scaler, "_found_inf_per_device", None)
    if method is None:
        raise RuntimeError(f"torch {torch.__version__}'s GradScaler has no _found_inf_per_device: "
                           "executor.ranks.grad_scaler needs torch 2.11 to 2.15")
    found: dict[torch.device, torch.Tensor] = method(optimizer)
    return found
