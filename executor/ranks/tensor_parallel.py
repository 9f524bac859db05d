"""The collectives of a tensor-parallel group, as the modules a rewritten stage calls, and the
(dp, pp, tp) DeviceMesh.

    mesh = tensor_parallel_mesh(1, 2, 2, device="cpu", timeout=60)   # 4 ranks: PP 2 x TP 2
    ops = TensorParallelOps(mesh)       # autopipe.frontend.building.tensor_parallel.shard_stage(..., ops)

[Note: tensor parallelism on ranks] (autopipe/frontend/building/tensor_parallel.py) says where
each goes. Megatron's f (``copy``: identity forward, the input gradient all-reduced) and g
(``reduce``: the output all-reduced, its gradient as is) are autograd functions over the "tp"
group; ``gather`` all-gathers the head's logits along the vocabulary and slices the gradient
(every rank holds the same whole gradient: the loss runs on every rank alike); ``part_rows``
takes rank j's rows of each part of a fused weight held whole and all-reduces its gradient
(the parts' other rows have their gradients on the other ranks), so every rank holds the whole
gradient of the whole weight; ``embedding`` looks up the ids of this rank's vocabulary rows
(the rest zero) and all-reduces. A split parameter is a DTensor ``Shard(dim)`` on the "tp"
mesh dimension: DCP saves shards, FSDP2 shards it again over "dp", ``full_tensor`` gathers it.

Under sequence parallelism the tokens (a value's second-to-last dimension) split too:
``reduce(tokens=True)`` reduce-scatters them (its gradient all-gathered), ``copy(tokens=True)``
all-gathers them before a column (its gradient reduce-scattered), ``whole_tokens`` all-gathers
them for a replicated reader (its gradient sliced), ``slice_tokens`` takes rank j's of a whole
value (its gradient all-gathered), and ``embedding(tokens=True)`` reduce-scatters the lookup.
Each refuses in one line a token count the degree does not divide.

[Note: the (dp, pp, tp) mesh] The plan's rank order (autopipe/solvers/tensor_parallel_search.py,
[Note: the mesh]): global rank ``(r x K + s) x t + j`` for TP rank j of pipeline rank s of
replica r: ``init_device_mesh(type, (D, K, t), mesh_dim_names=("dp", "pp", "tp"))``. A TP group
is t neighbouring ranks (one host), a "pp" group one pipeline of TP rank j, which sends to TP
rank j of the next stage, and a "dp" group the replicas of one stage's TP rank j.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from executor._torch_compat import mesh_group_options
from executor.errors import DistributedError

__all__ = ["MESH_DIMS", "tensor_parallel_mesh", "TensorParallelOps", "tokens_error", "token_share"]

MESH_DIMS = ("dp", "pp", "tp")


def tensor_parallel_mesh(data_parallel: int, pp_size: int, degree: int, *, device: torch.device | str,
                         timeout: float | None = 60.0) -> DeviceMesh:
    """The (dp, pp, tp) DeviceMesh ([Note: the (dp, pp, tp) mesh]); call it on every rank."""
    world = dist.get_world_size()
    if min(data_parallel, pp_size, degree) < 1 or data_parallel * pp_size * degree != world:
        raise DistributedError(f"{data_parallel} replica(s) x {pp_size} pipeline rank(s) x tensor_parallel="
                               f"{degree} need {data_parallel * pp_size * degree} ranks but the world has "
                               f"{world}; start PP x TP x DP ranks")
    override: dict[int | str, Any] | None = None
    if timeout is not None:
        options = mesh_group_options(dist.get_backend(), datetime.timedelta(seconds=timeout))
        override = None if options is None else {d: options for d in MESH_DIMS}
    return init_device_mesh(torch.device(device).type, (data_parallel, pp_size, degree),
                            mesh_dim_names=MESH_DIMS, backend_override=override)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


Collective = Callable[[Tensor, dist.ProcessGroup], Tensor]


def _pair(name: str, forward: Collective, backward: Collective) -> Any:
    """An autograd Function running ``forward(x, group)`` and, on the gradient, ``backward``."""
    def fwd(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return forward(x, group)

    def bwd(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _same(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return x.view_as(x)


_Copy = _pair("_Copy", _same, _all_reduce)  # Megatron's f
_Reduce = _pair("_Reduce", _all_reduce, _same)  # Megatron's g


class _PartRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: Tensor, sizes: Sequence[int], rank: int, degree: int,
                group: dist.ProcessGroup) -> Tensor:
        ctx.shape, ctx.sizes, ctx.rank, ctx.degree, ctx.group = w.shape, sizes, rank, degree, group
        return torch.cat([part.chunk(degree, 0)[rank] for part in w.split(list(sizes), 0)], 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        whole = grad.new_zeros(ctx.shape)
        local = grad.split([s // ctx.degree for s in ctx.sizes], 0)
        for part, g in zip(whole.split(list(ctx.sizes), 0), local, strict=True):
            part.chunk(ctx.degree, 0)[ctx.rank].copy_(g)
        return _all_reduce(whole, ctx.group), None, None, None, None


def tokens_error(tokens: int, degree: int) -> str:
    """The one line for a token count the TP degree does not divide."""
    return (f"sequence parallelism splits the {tokens} tokens over tensor_parallel={degree} ranks, which do not "
            f"divide them: pad the sequence to a multiple of {degree}, or plan with sequence_parallel=False")


def token_share(shape: Sequence[int], degree: int) -> tuple[int, ...]:
    """One rank's share of ``shape``'s tokens (dimension -2), or the one line for a count the
    degree does not divide (every rank raises it alike, before any collective)."""
    if degree == 1:
        return tuple(shape)
    if len(shape) < 2 or shape[-2] % degree:
        raise DistributedError(tokens_error(int(shape[-2]) if len(shape) >= 2 else 0, degree))
    return (*shape[:-2], shape[-2] // degree, shape[-1])


def _check_tokens(x: Tensor, degree: int) -> None:
    token_share(x.shape, degree)


def _gather(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Every rank's ``x``, joined along ``dim`` in rank order (an all-gather)."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (what :func:`_gather` put there)."""
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


_gather_tokens = functools.partial(_gather, dim=-2)  # every rank's tokens (dimension -2)


def _scatter_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum over the group of this rank's share of the tokens (a reduce-scatter)."""
    degree = dist.get_world_size(group)
    _check_tokens(x, degree)
    if dist.get_backend(group) == "nccl":  # reduce_scatter_tensor splits dimension 0
        front = x.movedim(-2, 0).contiguous()
        out = front.new_empty((front.shape[0] // degree, *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, group=group)
        return out.movedim(0, -2).contiguous()
    return _own(_all_reduce(x, group), group, -2)  # gloo: no reduce-scatter


def _slice_tokens(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    _check_tokens(x, dist.get_world_size(group))
    return _own(x, group, -2)


_Gather = _pair("_Gather", functools.partial(_gather, dim=-1), functools.partial(_own, dim=-1))  # the head's logits
_ScatterTokens = _pair("_ScatterTokens", _scatter_tokens, _gather_tokens)  # a row's g under sequence parallelism
_GatherTokens = _pair("_GatherTokens", _gather_tokens, _scatter_tokens)  # a column's f under sequence parallelism
_WholeTokens = _pair("_WholeTokens", _gather_tokens, _slice_tokens)  # for a reader every rank runs alike
_SliceTokens = _pair("_SliceTokens", _slice_tokens, _gather_tokens)  # a whole value entering the split tokens


class _Collective(nn.Module):
    def __init__(self, kind: Any, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.kind, self.group = kind, group

    def forward(self, x: Tensor) -> Tensor:
        return self.kind.apply(x, self.group)  # type: ignore[no-any-return]


class _PartRowsOf(nn.Module):
    def __init__(self, sizes: Sequence[int], rank: int, degree: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.sizes, self.rank, self.degree, self.group = list(sizes), rank, degree, group

    def forward(self, w: Tensor) -> Tensor:
        return _PartRows.apply(w, self.sizes, self.rank, self.degree, self.group)  # type: ignore[no-any-return]


class _VocabEmbedding(nn.Module):
    """Rows ``start`` .. ``start + size`` of a vocabulary: their ids looked up, the rest zero, summed
    over the group."""

    def __init__(self, start: int, size: int, padding_idx: int | None, group: dist.ProcessGroup,
                 tokens: bool = False) -> None:
        super().__init__()
        self.start, self.size, self.group = start, size, group
        self.sum: Any = _ScatterTokens if tokens else _Reduce
        inside = padding_idx is not None and start <= padding_idx < start + size
        self.padding_idx = padding_idx - start if inside and padding_idx is not None else None

    def forward(self, ids: Tensor, weight: Tensor) -> Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.size)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.start)
        out = F.embedding(local, weight, padding_idx=self.padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.sum.apply(out, self.group)  # type: ignore[no-any-return]


class TensorParallelOps:
    """This rank's place in its TP group and the group's collectives (the ops
    autopipe.frontend.building.tensor_parallel.shard_stage takes)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.mesh_dim_names != MESH_DIMS:
            raise DistributedError(f"mesh has dims {mesh.mesh_dim_names}, not {MESH_DIMS}; make it with "
                                   "executor.ranks.tensor_parallel.tensor_parallel_mesh(dp, pp, tp)")
        self.mesh, self.tp_mesh = mesh, mesh["tp"]
        self.group = mesh.get_group("tp")
        self.degree, self.rank = mesh.size(2), mesh.get_local_rank("tp")

    def copy(self, tokens: bool = False) -> nn.Module:
        return _Collective(_GatherTokens if tokens else _Copy, self.group)

    def reduce(self, tokens: bool = False) -> nn.Module:
        return _Collective(_ScatterTokens if tokens else _Reduce, self.group)

    def whole_tokens(self) -> nn.Module:
        return _Collective(_WholeTokens, self.group)

    def slice_tokens(self) -> nn.Module:
        return _Collective(_SliceTokens, self.group)

    def gather(self) -> nn.Module:
        return _Collective(_Gather, self.group)

    def part_rows(self, sizes: Sequence[int]) -> nn.Module:
        return _PartRowsOf(sizes, self.rank, self.degree, self.group)

    def embedding(self, start: int, size: int, padding_idx: int | None, tokens: bool = False) -> nn.Module:
        return _VocabEmbedding(start, size, padding_idx, self.group, tokens)

    def parameter(self, local: Tensor, dim: int, requires_grad: bool) -> nn.Parameter:
        split = DTensor.from_local(local.detach(), self.tp_mesh, [Shard(dim)], run_check=False)
        return nn.Parameter(split, requires_grad=requires_grad)
