"""The gradient norm of a whole pipeline, and clipping by it, over its devices, ranks and replicas.

[Note: one norm over stages and ranks] ``pipe.clip_grad_norm_(max_norm, norm_type)`` returns
what ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` returns on the plain model,
on every rank, and scales every gradient copy as it would. Each parameter counts once:

- in one process (executor.GPipe) a parameter tied across devices is registered on its first
  stage only ([Note: ties across devices] in executor/local/placement.py), so the pipeline's
  ``parameters()`` already name each once, whatever devices they are on;
- on ranks, a tied parameter has a full copy on each rank that uses it, equal after the step
  ([Note: tied parameters across ranks] in executor/ranks/distributed.py): only the lowest rank of
  its tie group counts it, every copy is scaled;
- under FSDP2 a gradient is a DTensor sharded over the replicas ("dp" group): each rank counts
  its local shard, and the shards' ``|g|^p`` sums are summed over the dp group;
- under DDP every replica holds the same, averaged gradient: nothing is reduced over the dp
  group, so the D replicas are not counted D times.

The local part is ``sum |g|^p`` over the counted gradients (``max |g|`` for ``inf``), reduced
with SUM (MAX) first over the shard group, then over the pipeline's group; the norm is its
``1/p``-th power. Every rank runs the same collectives in the same order, even one with no
gradients (it contributes zero), so none waits on another. The clipping coefficient is
torch's: ``max_norm / (norm + 1e-6)``, clamped to 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from executor.errors import ExecutorError

__all__ = ["NonFiniteNormError", "check_norm_type", "clip_grads_", "counted_once", "local_grads"]


class NonFiniteNormError(RuntimeError):
    """The total gradient norm is nan or inf and ``error_if_nonfinite=True`` (as torch's)."""


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float: a positive number or ``inf``, else a one-line ExecutorError."""
    value = float(norm_type)
    if not value > 0:  # nan and -inf too
        raise ExecutorError(f"norm_type={norm_type!r} is not a norm a pipeline can clip by; use a "
                            "positive number (2.0, the default) or float('inf')")
    return value


def local_grads(grads: Iterable[Tensor | None]) -> tuple[list[Tensor], list[Tensor]]:
    """The plain gradients and the local shards of the DTensor (FSDP2) ones, Nones left out."""
    plain: list[Tensor] = []
    shards: list[Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            shards.append(g.to_local())
        elif g is not None:
            plain.append(g)
    return plain, shards


def _partial(grads: Sequence[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |g|^p`` (``max |g|`` for inf) of ``grads``, a float32 scalar on ``device``."""
    out = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel() == 0:
            continue
        if math.isinf(p):
            out = torch.maximum(out, g.detach().abs().max().to(device, torch.float32))
        else:
            norm = torch.linalg.vector_norm(g.detach(), p, dtype=torch.float32)
            out = out + norm.to(device).pow(p)
    return out


def _split_over(g: DTensor, tp_group: dist.ProcessGroup | None) -> tuple[bool, bool]:
    """Whether a DTensor gradient is split over the replicas (any mesh dimension but "tp") and
    over the TP group (its "tp" dimension; only when there is one)."""
    names = g.device_mesh.mesh_dim_names or tuple(str(i) for i in range(g.device_mesh.ndim))
    split = {name for name, placement in zip(names, g.placements, strict=True) if not placement.is_replicate()}
    over_tp = tp_group is not None and "tp" in split
    return bool(split - {"tp"}) or not over_tp, over_tp


def _reduce(value: Tensor, p: float, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        dist.all_reduce(value, op=op, group=group)
    return value


def clip_grads_(
    counted: Iterable[Tensor | None],
    copies: Iterable[Tensor | None],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    device: torch.device,
    shard_group: dist.ProcessGroup | None = None,
    groups: Sequence[dist.ProcessGroup] = (),
    tp_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Clip ``counted`` and ``copies`` (gradients) by the norm of ``counted`` over the ranks.

    ``copies`` are gradients scaled but not counted (a tied parameter another rank counts).
    DTensor gradients are shards: their part is reduced over ``shard_group`` first (and over
    ``tp_group`` for those split over a "tp" mesh dimension); then the whole over each of
    ``groups`` (see [Note: one norm over stages and ranks]). Returns the total norm on
    ``device``, the same on every rank.
    """
    p = check_norm_type(norm_type)
    counted = list(counted)  # read twice: an iterator would be empty the second time
    plain, shards = local_grads(counted)
    plain_copies, shard_copies = local_grads(copies)
    total = _partial(plain, p, device)
    # the shards by the groups they are split over: every kind on every rank, in this order, so
    # that each rank joins the same reductions (an empty kind's part is zero)
    kinds = ((True, False), (False, True), (True, True)) if tp_group is not None else ((True, False),)
    split: dict[tuple[bool, bool], list[Tensor]] = {kind: [] for kind in kinds}
    for g in counted:
        if isinstance(g, DTensor):
            split[_split_over(g, tp_group)].append(g.to_local())
    for (over_dp, over_tp), local in split.items():
        part = _reduce(_partial(local, p, device), p, shard_group if over_dp else None)
        part = _reduce(part, p, tp_group if over_tp else None)
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    for group in groups:
        total = _reduce(total, p, group)
    norm = total if math.isinf(p) else total.pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise NonFiniteNormError(
            f"the total gradient norm of order {norm_type} is {norm.item()}, so the gradients "
            "cannot be clipped: a gradient overflowed (under fp16, step through a GradScaler, "
            "which skips such steps) or pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in [*plain, *shards, *plain_copies, *shard_copies]:
            g.mul_(coef.to(g.device, g.dtype))
    return norm


def counted_once(params: Iterable[torch.nn.Parameter],
                 ties: Sequence[tuple[dist.ProcessGroup | None, torch.nn.Parameter | None]],
                 ) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """This rank's gradients, each parameter once: those it counts, and the tied copies a lower
    rank of their tie group counts ([Note: one norm over stages and ranks])."""
    me = dist.get_rank()
    others = {id(p) for group, p in ties
              if p is not None and group is not None and min(dist.get_process_group_ranks(group)) != me}
    seen: set[int] = set()
    counted: list[Tensor | None] = []
    copies: list[Tensor | None] = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            (copies if id(p) in others else counted).append(p.grad)
    return counted, copies
