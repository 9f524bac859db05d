"""Replicas of a pipeline on a 2-D DeviceMesh: data parallel across, pipeline along.

    mesh = pipeline_mesh(2, 2, device=torch.device("cpu"), timeout=60)   # 4 ranks
    pipe = ReplicatedPipeline([stage], [mesh.get_local_rank("pp")], 2, mesh=mesh, dp_mode="ddp",
                              loss_fn=F.cross_entropy, wires=wires)
    loss = pipe.step(x_local, target=y_local)   # this replica's own batch

[Note: replicas on a mesh] D replicas of a K-stage pipeline run on D x K ranks laid out as
torchtitan lays them: ``init_device_mesh(device_type, (D, K), mesh_dim_names=("dp", "pp"))``,
rank = dp_index x K + pp_index. Each row (a "pp" group) is one pipeline, run exactly as
:class:`DistributedPipeline` runs one (its schedule and size agreement on the row's group);
each column (a "dp" group) holds the D copies of one stage. A stage's gradients are averaged
over its column by PyTorch's own engines, wrapped around the stage's WireStage, the module
torch's PipelineStage runs, so PipelineStage synchronises once per step itself
(``backward_maybe_with_nosync``, ``perform_reduce_grad``):

- ``dp_mode="ddp"``: DistributedDataParallel, all-reduce in ``no_sync`` until the last
  micro-batch's backward; gradients as bucket views (the planner's memory model,
  autopipe/core/data_parallel.py); ``forward_sync_buffers=False``, so buffers (BatchNorm
  statistics) are each replica's own after DDP's broadcast at construction, as in DDP without
  SyncBatchNorm (and no collective in every micro-batch's forward);
- ``dp_mode="fsdp"``: FSDP2 ``fully_shard(wire, mesh=mesh["dp"], reshard_after_forward=False)``:
  parameters, gradients and the optimizer's state sharded over the column, one all-gather
  before the first forward and one reduce-scatter after the last backward.

Mixed precision ([Note: distributed mixed precision] in executor/precision.py): under
``precision="bf16"`` / ``"fp16"`` the stage computes under autocast either way; FSDP2 also
all-gathers the parameters in that dtype and reduce-scatters the gradients in fp32
(``MixedPrecisionPolicy(param_dtype=<low>, reduce_dtype=torch.float32)``, leaving the stage's
inputs as they arrive: ``cast_forward_inputs=False``, so an fp32 residual stream stays fp32, as
under autocast), over fp32 shards, gradients and optimizer state; DDP keeps fp32 parameters
and gradients and all-reduces them in fp32 (autocast only).

[Note: DDP under zero bubble] The zero-bubble schedules compute weight gradients apart from the
backward torch's DDP hooks into (their W: executor/ranks/split_backward.py), so DDP's reducer would
not see them (pytorch#144530: PP+DDP does not work for zero bubble). Under those schedules
``dp_mode="ddp"`` therefore wraps no stage: the stage's parameters and buffers are broadcast
from the column's first rank when the pipeline is built, as DDP does, and after each step the
pipeline all-reduces the mean of its gradients over the column itself, in buckets of
``_BUCKET_BYTES`` (DDP's default 25 MiB): the same averaged gradients, the same one all-reduce
per step that DDP's ``no_sync`` until the last micro-batch leaves, not overlapped with the last
backward. FSDP2 needs no such help: torch's schedule reduce-scatters once per step itself.

After the step DistributedPipeline divides by the micro-batches and sums tied copies within
each row ([Note: tied parameters across ranks]); both are linear, so their order with the
replicas' mean does not matter: every copy ends with the gradient of the mean loss over all
D x M micro-batches of the global batch. Every replica starts from the same weights (the
caller broadcasts them; DDP broadcasts again from the column's first rank).

Failure detection: both mesh dimensions' groups and the ties' groups are created with
``timeout`` (executor._torch_compat.mesh_group_options), so a dead or silent peer in this rank's
row or column fails its step within the timeout as :class:`PipelineFailure` naming this rank,
its place and both its groups; the step's watchdog ([Note: a dead rank is an error, not a
hang]) covers the whole step, collectives included. A dead rank's row and column fail first
and end their processes, which fails the rest in turn.

Checkpoints: :meth:`ReplicatedPipeline.state_dict` is this stage's part under the model's keys,
as a pipeline's ([Note: checkpoint parts]), the same on every replica: save it on
``dp_rank == 0`` only. Under FSDP it gathers the full tensors (``DTensor.full_tensor``, a
collective over the column), so call it on every rank. Merged, the parts are the plain model's
state_dict, which loads into a pipeline of any number of replicas.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from executor._torch_compat import mesh_group_options
from executor.checkpoint import CheckpointView
from executor.decision import Decision
from executor.errors import DistributedError
from executor.model_loss import ModelLoss
from executor.precision import compute_dtype
from executor.ranks.distributed import DistributedPipeline
from executor.ranks.ties import check_fsdp_ties
from executor.ranks.watchdog import FIRST_STEP_TIMEOUT_S, StepLimits
from executor.ranks.wire import WireStage
from executor.spec import DATA_PARALLEL_MODES, ZERO_BUBBLE_SCHEDULES

__all__ = ["pipeline_mesh", "tie_group", "ReplicatedPipeline"]

_BUCKET_BYTES = 25 * 2**20  # [Note: DDP under zero bubble]: gradients all-reduced at once

# Buffers synchronised once at construction, never in a forward: torch 2.13 on says so with
# forward_sync_buffers=False; before it (2.11, 2.12) broadcast_buffers=False was that switch.
_NO_FORWARD_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False})


def pipeline_mesh(data_parallel: int, pp_size: int, *, device: torch.device | str,
                  timeout: float | None = 60.0) -> DeviceMesh:
    """The (dp, pp) DeviceMesh of ``data_parallel`` replicas of a ``pp_size``-rank pipeline, its
    groups created with ``timeout`` seconds (None: torch's default; see [Note: replicas on a
    mesh]). Call it on every rank."""
    world = dist.get_world_size()
    if data_parallel < 1 or pp_size < 1 or data_parallel * pp_size != world:
        raise DistributedError(f"{data_parallel} replica(s) x {pp_size} pipeline rank(s) need "
                               f"{data_parallel * pp_size} ranks but the world has {world}; start "
                               "data_parallel x pipeline ranks")
    backend = dist.get_backend()
    dims = ("dp", "pp")
    override: dict[int | str, Any] | None = None
    if timeout is not None:
        timedelta = datetime.timedelta(seconds=timeout)
        override = {d: mesh_group_options(backend, timedelta) for d in dims}
    return init_device_mesh(torch.device(device).type, (data_parallel, pp_size), mesh_dim_names=dims,
                            backend_override=override if override and None not in override.values()
                            else None)


def tie_group(mesh: DeviceMesh, pp_ranks: Sequence[int],
              timeout: datetime.timedelta | None) -> dist.ProcessGroup | None:
    """This rank's group of ``pp_ranks`` within its own replica (and TP rank, on a (dp, pp, tp)
    mesh): one group per row of pipeline ranks, every rank creating all of them."""
    grid = mesh.mesh.movedim(1, -1).reshape(-1, mesh.mesh.shape[1])  # each (dp[, tp]) -> its pp ranks
    per_row = [[int(row[r]) for r in sorted(pp_ranks)] for row in grid]
    mine, _ = dist.new_subgroups_by_enumeration(per_row, timeout=timeout)
    return mine  # type: ignore[no-any-return]


class ReplicatedPipeline(DistributedPipeline):
    """This rank's stage(s) of one replica of a pipeline, kept in step with the other replicas.

    Args as :class:`DistributedPipeline`, plus ``mesh`` (from :func:`pipeline_mesh`) and
    ``dp_mode`` (``ddp`` or ``fsdp``); ``indices`` are stage indices of this rank's pipeline and
    ``ties`` name ranks of the pipeline (its "pp" group). See [Note: replicas on a mesh].
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        indices: Sequence[int],
        num_stages: int | None = None,
        *,
        mesh: DeviceMesh,
        dp_mode: str | None = None,
        ties: Sequence[tuple[Sequence[int], nn.Parameter | None]] = (),
        timeout: float | None = 60.0,
        first_step_timeout: float | None = FIRST_STEP_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        if mesh.mesh_dim_names not in (("dp", "pp"), ("dp", "pp", "tp")):
            raise DistributedError(f"mesh has dims {mesh.mesh_dim_names}, not ('dp', 'pp'); make it "
                                   "with executor.ranks.replicated.pipeline_mesh(data_parallel, pp_size)")
        decision: Decision | None = kwargs.get("decision")
        if decision is not None:  # the replicas' part of it ([Note: a plan's decision])
            if dp_mode is not None and dp_mode != decision.dp_mode:
                raise DistributedError(f"dp_mode={dp_mode!r} and a decision of dp_mode="
                                       f"{decision.dp_mode!r} were both given; pass the decision alone")
            if decision.data_parallel != mesh.size(0):
                raise DistributedError(f"the decision is for data_parallel={decision.data_parallel} "
                                       f"but the mesh has {mesh.size(0)} replicas; make the mesh with "
                                       f"pipeline_mesh({decision.data_parallel}, pp_size)")
            dp_mode = decision.dp_mode
        dp_mode = dp_mode or DATA_PARALLEL_MODES[0]
        if dp_mode not in DATA_PARALLEL_MODES:
            raise DistributedError(f"dp_mode={dp_mode!r} is unknown; use one of {list(DATA_PARALLEL_MODES)}")
        self.mesh, self.dp_mode = mesh, dp_mode
        self.dp_rank, self.dp_size = mesh.get_local_rank("dp"), mesh.size(0)
        self._all_reduce: list[nn.Parameter] = []  # [Note: DDP under zero bubble]
        if dp_mode == "fsdp":
            check_fsdp_ties(stages, indices, decision.schedule if decision is not None
                            else kwargs.get("schedule", "gpipe"))
        group_timeout = StepLimits(timeout, first_step_timeout).group_timeout
        groups = [tie_group(mesh, ranks, group_timeout) for ranks, _ in ties]
        super().__init__(stages, indices, num_stages, group=mesh.get_group("pp"), timeout=timeout,
                         first_step_timeout=first_step_timeout,
                         ties=[(g, p) for g, (_, p) in zip(groups, ties, strict=True)], **kwargs)

    def _groups(self) -> list[dist.ProcessGroup]:
        return [*super()._groups(), self.mesh.get_group("dp")]

    def _shard_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp") if self.dp_mode == "fsdp" else None

    def found_inf_groups(self) -> list[dist.ProcessGroup]:
        return [*super().found_inf_groups(), self.mesh.get_group("dp")]

    def _replicate(self, wire: WireStage) -> nn.Module:
        dp_mesh = self.mesh["dp"]
        if self.dp_mode == "fsdp":
            low = compute_dtype(self.precision)
            policy = (MixedPrecisionPolicy() if low == torch.float32 else
                      MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                           cast_forward_inputs=False))
            fully_shard(wire, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
            return wire
        if not any(p.requires_grad for p in wire.parameters()):
            return wire  # DDP refuses a module with nothing to synchronise (a stage of only ReLUs)
        if self.schedule_name in ZERO_BUBBLE_SCHEDULES:  # [Note: DDP under zero bubble]
            group = self.mesh.get_group("dp")
            with torch.no_grad():
                for t in [*wire.parameters(), *wire.buffers()]:
                    dist.broadcast(t, group=group, group_src=0)
            self._all_reduce += [p for p in wire.parameters()
                                 if p.requires_grad and all(p is not q for q in self._all_reduce)]
            return wire
        ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(wire, device_ids=ids, device_mesh=dp_mesh,
                                       gradient_as_bucket_view=True, **_NO_FORWARD_BUFFER_SYNC)

    # [Note: tokens over replicas] The model's own loss is a mean over the items the whole
    # mini-batch counts ([Note: a loss the model computes] in executor/model_loss.py): with R
    # replicas holding N_r of the N items, the one-process loss is sum(N_r * L_r) / N, where L_r
    # is replica r's own token-weighted mean. DDP and FSDP average the replicas' gradients, so each
    # replica's last rank weighs its micro-batches by n_i / N x R instead of n_i / N_r (N: the
    # counts all-reduced over the dp group, which holds the last rank of every replica, inside the
    # step's watchdog), and reports the all-reduced mean of those losses: the one-process loss on
    # every replica, whatever the padding on each. A loss_fn of the caller's is weighted by rows
    # and each replica reports its own; eval_step weighs each replica's batch on its own, since
    # replicas may evaluate alone. Given ``num_items_in_batch`` (N over every replica and every
    # batch accumulated into the optimizer step, as HuggingFace counts it), N is not added up:
    # the weights are n_i / N x R.
    def _replica_weights(self, target: Any) -> Any:
        if not (self.is_last and isinstance(self._loss_fn, ModelLoss)):
            return target
        if self._num_items is not None:
            return target * self.dp_size
        total = torch.tensor(self._counted, dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.mesh.get_group("dp"))
        if float(total) == 0:
            raise DistributedError("no replica's batch has counted items (every label is the loss's "
                                   "ignore_index): the loss is undefined; pass batches with labels")
        return target * (self._counted / float(total) * self.dp_size)

    def _replica_loss(self, mean: Tensor) -> Tensor:
        if not isinstance(self._loss_fn, ModelLoss):
            return mean
        summed = mean.detach().clone()
        dist.all_reduce(summed, group=self.mesh.get_group("dp"))
        return summed / self.dp_size

    def _finish_grads(self, before: Sequence[Tensor | None] = ()) -> None:
        super()._finish_grads(before)
        grads = [p.grad for p in self._all_reduce if p.grad is not None]
        group = self.mesh.get_group("dp")
        while grads:  # [Note: DDP under zero bubble]: the mean over the column, a bucket at a time
            bucket: list[Tensor] = []
            size = 0
            while grads and (not bucket or size + grads[0].nbytes <= _BUCKET_BYTES) and (
                    not bucket or grads[0].dtype == bucket[0].dtype):
                bucket.append(grads.pop(0))
                size += bucket[-1].nbytes
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(self.dp_size)
            for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(part.view_as(g))

    def _reshard(self) -> None:
        for wire in self.wire_stages:
            if isinstance(wire, FSDPModule):
                wire.reshard()  # sharded parameters registered, whatever the last call left

    def _checkpoint_view(self) -> CheckpointView:
        """FSDP's sharded parameters (DCP saves each rank's shards, and reshards on load)."""
        self._reshard()
        return super()._checkpoint_view()

    def state_dict(self) -> dict[str, Any]:
        """This stage's part (see [Note: replicas on a mesh]); under FSDP a collective."""
        self._reshard()
        out = super().state_dict()
        full: dict[int, Tensor] = {}
        with self._peer_failures():
            for key, value in out.items():
                if isinstance(value, DTensor):
                    if id(value) not in full:
                        full[id(value)] = value.full_tensor()
                    out[key] = full[id(value)]
        out._metadata[self.PART_METADATA].update(  # type: ignore[attr-defined]
            replica=self.dp_rank, replicas=self.dp_size)
        return out

    def _who(self) -> str:
        row = dist.get_process_group_ranks(self.mesh.get_group("pp"))
        column = dist.get_process_group_ranks(self.mesh.get_group("dp"))
        return (f"rank {dist.get_rank()}/{dist.get_world_size()} (pipeline rank {self.pp_rank}/"
                f"{self.pp_size} of pp group {row}, replica {self.dp_rank}/{self.dp_size} of dp "
                f"group {column})")
