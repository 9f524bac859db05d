"""Replicas of a distributed pipeline: how many, how they share gradients, and which runtime.

:func:`autopipe.distributed_pipeline` with ``data_parallel=D`` runs D replicas of a pipeline of
world / D ranks on a (dp, pp) DeviceMesh ([Note: replicas on a mesh] in executor/ranks/replicated.py);
D = 1 is the plain :class:`executor.DistributedPipeline`, as before replicas existed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from executor.decision import Decision
from executor.ranks.distributed import DistributedPipeline
from executor.ranks.replicated import ReplicatedPipeline, pipeline_mesh, tie_group
from executor.ranks.watchdog import StepLimits
from executor.spec import DATA_PARALLEL_MODES

__all__ = ["RankPipeline", "ReplicatedRankPipeline", "replicas_of", "replicated_pipeline"]


def replicas_of(plan: Plan | None, data_parallel: int | str | None, dp_mode: str | None,
                world: int) -> tuple[int, str]:
    """The number of replicas and the dp mode for ``world`` ranks, or a one-line BuildError."""
    if dp_mode is not None and dp_mode not in DATA_PARALLEL_MODES:
        raise BuildError(f"dp_mode={dp_mode!r} is unknown; use one of {list(DATA_PARALLEL_MODES)}")
    if plan is not None and dp_mode is not None and plan.data_parallel > 1 and dp_mode != plan.dp_mode:
        raise BuildError(f"the plan was made for dp_mode={plan.dp_mode!r} but dp_mode={dp_mode!r} "
                         f"was given; leave dp_mode out or make the plan with `autopipe partition "
                         f"--dp-mode {dp_mode}`")
    mode = dp_mode or (plan.dp_mode if plan is not None else "ddp")
    if data_parallel is None or data_parallel == "auto":
        if data_parallel == "auto" and plan is None:
            raise BuildError("data_parallel='auto' picks D for one global batch, which a rank's local "
                             "example does not give; pass plan=partition(profile, devices=N, "
                             "batch_size=B, data_parallel='auto') (each rank then feeds B / "
                             "plan.data_parallel rows) or data_parallel=D")
        replicas = plan.data_parallel if plan is not None else 1
    elif isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise BuildError(f"data_parallel={data_parallel!r} is not a number of replicas; pass an "
                         "integer >= 1, 'auto' or None (the plan's)")
    else:
        replicas = data_parallel
        if plan is not None and plan.data_parallel != replicas:
            raise BuildError(f"the plan was made for data_parallel={plan.data_parallel} but "
                             f"data_parallel={replicas} was given; leave it out (the plan's) or make "
                             f"the plan with `autopipe partition --data-parallel {replicas}`")
    if world % replicas:
        raise BuildError(f"{world} ranks do not split into data_parallel={replicas} replicas; start "
                         f"a multiple of {replicas} ranks (torchrun --nproc_per_node "
                         f"{replicas} x stages) or pass a data_parallel that divides {world}")
    return replicas, mode


class _SavesPretrained:
    """``save_pretrained`` for the rank pipelines that distributed_pipeline() returns."""

    _configs: tuple[Any, Any, frozenset[str]] = (None, None, frozenset())  # distributed_pipeline sets them
    plan: Plan | None = None  # the plan it runs: given, or made on rank 0 and broadcast

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Save the model as ``model.save_pretrained(folder)`` would, each rank its own stages'
        shards; call it on every rank ([Note: saved as the model] in
        autopipe/assemble/pretrained.py). Returns the index's path."""
        from autopipe.assemble.pretrained import save_on_ranks

        return save_on_ranks(self, self._configs, folder, overwrite=overwrite)


class RankPipeline(_SavesPretrained, DistributedPipeline):
    """An executor.DistributedPipeline that also saves itself as the model would."""


class ReplicatedRankPipeline(_SavesPretrained, ReplicatedPipeline):
    """An executor.ReplicatedPipeline that also saves itself as the model would."""


def replicated_pipeline(
    stages: Sequence[nn.Module], indices: Sequence[int], decision: Decision, *, device: torch.device,
    timeout: float | None, first_step_timeout: float | None, mesh: DeviceMesh | None = None, **kwargs: Any,
) -> RankPipeline | ReplicatedRankPipeline:
    """This rank's pipeline: one of ``decision.data_parallel`` replicas on a mesh, or the only one;
    with a (dp, pp, tp) ``mesh`` ([Note: the (dp, pp, tp) mesh]) the pipeline of this TP rank."""
    from torch.distributed import get_world_size

    group_timeout = StepLimits(timeout, first_step_timeout).group_timeout  # [Note: the first step's own limit]
    pipe: RankPipeline | ReplicatedRankPipeline
    if decision.data_parallel == 1 and mesh is None:
        return RankPipeline(stages, indices, decision=decision, device=device, timeout=timeout,
                            first_step_timeout=first_step_timeout, **kwargs)
    if decision.data_parallel == 1:  # TP alone: the mesh's pp group, ties within this TP rank
        assert mesh is not None
        ties = [(tie_group(mesh, ranks, group_timeout), p) for ranks, p in kwargs.pop("ties", ())]
        pipe = RankPipeline(stages, indices, decision=decision, device=device, timeout=timeout,
                            first_step_timeout=first_step_timeout, group=mesh.get_group("pp"), ties=ties, **kwargs)
    else:
        replicas = decision.data_parallel
        if mesh is None:
            mesh = pipeline_mesh(replicas, get_world_size() // replicas, device=device,
                                 timeout=None if group_timeout is None else group_timeout.total_seconds())
        pipe = ReplicatedRankPipeline(stages, indices, mesh=mesh, decision=decision, device=device,
                                      timeout=timeout, first_step_timeout=first_step_timeout, **kwargs)
    if "tp" in (mesh.mesh_dim_names or ()):
        pipe.tp_group, pipe.tp_rank = mesh.get_group("tp"), mesh.get_local_rank("tp")
    return pipe
