"""What rank 0 works out and every rank receives: the plan, the weights and the wires.

    plan = plan_of_rank0(model, micro, graph, k, ...)   # rank 0 profiles and partitions
    weights_of_rank0(model, device)                     # every rank trains rank 0's weights
    wires = wires_of_rank0(stages, micro, precision, device)

See [Note: one plan on every rank] in ranks.py. Each is a collective: every rank calls it, and an
error on rank 0 is raised on every rank, never left for the others to wait on.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.core.plan import Plan
from autopipe.errors import first_line
from executor.ranks.distributed import DistributedError, Wire, infer_wires
from executor.spec import stage_rank

__all__ = ["plan_of_rank0", "wires_of_rank0", "weights_of_rank0", "SYNC_BUCKET_BYTES"]


def plan_of_rank0(model: nn.Module, micro: tuple[Any, ...], graph: Any, stages: int, *,
                 method: str, chunks: int, recompute: str, loss_fn: Callable[[Any, Any], Tensor] | None,
                 target: Any = None, precision: str = "fp32", schedule: str = "gpipe", ranks: int = 1,
                 device: torch.device | None = None) -> Plan:
    """Rank 0 profiles (the loss too, given the micro-batch's ``target``) and partitions for the
    distributed runtime and ``schedule``, its stages laid out on the ``ranks`` pipeline ranks as
    the schedule places them; every rank receives its plan (see [Note: one plan on every rank] in ranks.py) through
    ``device`` (autopipe.assemble.ranks._comm_device)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        from autopipe.frontend.profiling.profiler import profile
        from autopipe.solvers.partitioner import partition

        try:
            prof = profile(model, micro, graph=graph, loss_fn=None if target is None else loss_fn,
                           target=target, precision=precision)
            devices = [f"rank:{stage_rank(schedule, i, ranks)}" for i in range(stages)]
            box[0] = partition(prof, devices=devices, method=method, chunks=chunks, recompute=recompute,
                               runtime="distributed", schedule=schedule).to_dict()
        except ValueError as err:
            box[0] = err  # every rank raises it, instead of the others waiting forever
    dist.broadcast_object_list(box, src=0, device=device)
    if isinstance(box[0], ValueError):
        raise box[0]
    return Plan.from_dict(box[0])


def wires_of_rank0(stages: Sequence[nn.Module], probe: tuple[Any, ...], precision: str,
                    device: torch.device) -> list[tuple[Wire, ...]]:
    """The wires of every cut as rank 0 infers them ([Note: one plan on every rank] in ranks.py)."""
    box: list[Any] = [None]
    wires = None
    if dist.get_rank() == 0:
        try:
            wires = infer_wires(stages, probe, precision)
            box[0] = wires if _picklable(wires) else None  # None: every other rank infers its own
        except Exception as err:  # noqa: BLE001 - every rank raises it, instead of waiting for its wires
            box[0] = err if isinstance(err, DistributedError) else DistributedError(
                f"rank 0 could not run the stages on the example micro-batch: {first_line(err)}")
    dist.broadcast_object_list(box, src=0, device=device)
    if isinstance(box[0], DistributedError):
        raise box[0]
    if wires is None:
        wires = box[0] if box[0] is not None else infer_wires(stages, probe, precision)
    return wires


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    return True


SYNC_BUCKET_BYTES = 32 << 20  # rank 0's weights go out in flat buckets of about this size


def weights_of_rank0(model: nn.Module, device: torch.device) -> None:
    """Every rank's weights and buffers := rank 0's, one broadcast per bucket of tensors of one
    dtype (not one per tensor), each bucket crossing on ``device`` (autopipe.assemble.ranks._comm_device) and
    copied back into the tensors where they live."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    seen: set[int] = set()
    for t in model.state_dict(keep_vars=True).values():
        if isinstance(t, Tensor) and id(t) not in seen and t.numel():
            seen.add(id(t))
            by_dtype.setdefault(t.dtype, []).append(t)
    buckets: list[list[Tensor]] = []
    for tensors in by_dtype.values():
        first, size = len(buckets), 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if len(buckets) == first or size + nbytes > SYNC_BUCKET_BYTES:  # a larger tensor: alone
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += nbytes
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
            dist.broadcast(flat, src=0)
            if dist.get_rank() != 0:
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                    t.copy_(part.view_as(t))
