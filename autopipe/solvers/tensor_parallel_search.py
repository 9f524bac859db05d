"""The TP degree t: each stage's layers split over t ranks of one host, on ``devices = PP x TP x DP``.

[Note: the mesh] ``partition(..., devices=N, tensor_parallel=t)`` plans on N / t TP groups, each
t consecutive devices of the list (the innermost dimension of a (dp, pp, tp) mesh: a group's
ranks are neighbours, so a group of a divisor of the host's devices stays inside one host)
that act as one device of the least memory and speed among them; the replicas and the stages
are then taken from the groups as without TP ([Note: pipeline x data parallel]: replica r,
stage s is group ``r x K + s``, so global rank ``(r x K + s) x t + j`` is TP rank j of it). Every
cost is one rank's: the profile at degree t ([Note: tensor-parallel cost] in
autopipe/core/tensor_parallel.py), collectives included, so the solvers, the search and the
simulator run unchanged on it. ``tensor_parallel="auto"`` plans every degree that divides the
devices, the host and every group's heads or features, each with the ordinary solver or search
(and replica search), and keeps the shortest simulated iteration (a tie to the smaller degree);
``plan.alternatives`` then list the best plan of every other degree first. A degree that does
not fit in memory is left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from autopipe.core.devices import DeviceSpec
from autopipe.core.estimated import estimated_from
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PartitionError

__all__ = ["GPUS_PER_HOST", "host_size", "tp_groups", "with_degree", "search_degrees"]

GPUS_PER_HOST = 8  # an HGX / DGX host's GPUs: the host of an estimated profile on a GPU sheet


def host_size(profile: Profile, devices_per_host: object, devices: int | None) -> int | None:
    """The devices a TP group must stay inside: ``devices_per_host``, else 8 for a profile
    estimated on a GPU sheet, else every device is on one host (None)."""
    if devices_per_host is not None:
        if isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int) or devices_per_host < 1:
            raise PartitionError(f"devices_per_host={devices_per_host!r}: need an integer >= 1 (the devices "
                                 f"one host holds), or None")
        return devices_per_host
    if estimated_from(profile.meta) is not None and profile.meta.get("device_type") != "cpu":
        return GPUS_PER_HOST if devices is None else min(GPUS_PER_HOST, devices)
    return None


def tp_groups(pool: Sequence[DeviceSpec], degree: int) -> list[DeviceSpec]:
    """The N / t TP groups of ``pool`` ([Note: the mesh]), each named by its first device."""
    out = []
    for g in range(len(pool) // degree):
        same = pool[g * degree:(g + 1) * degree]
        limits = [d.memory for d in same if d.memory is not None]
        out.append(DeviceSpec(same[0].name, min(limits) if limits else None, min(d.speed for d in same)))
    return out


def with_degree(plan: Plan, degree: int, sequence: bool = False) -> Plan:
    """``plan`` and the alternatives it weighed, marked as planned at ``degree`` (split by tokens
    too where ``sequence``)."""
    if degree == 1:
        return plan
    return replace(plan, tensor_parallel=degree, sequence_parallel=sequence,
                   alternatives=[replace(a, tensor_parallel=degree) for a in plan.alternatives])


def search_degrees(degrees: list[int], solve: Callable[[int], Plan], sequence: bool = False) -> Plan:
    """The fastest simulated plan among ``solve(t)`` for every t in ``degrees`` ([Note: the
    mesh]), each t > 1 split by tokens too where ``sequence``; PartitionError (one line, the
    smallest degree's reason) when none fits."""
    start = time.perf_counter()
    plans: dict[int, Plan] = {}
    failed: dict[int, PartitionError] = {}
    for t in degrees:
        try:
            plans[t] = with_degree(solve(t), t, sequence)
        except PartitionError as err:
            failed[t] = err
    if not plans:
        t = min(failed)
        if len(degrees) == 1:
            raise PartitionError(f"tensor_parallel={t}: {failed[t]}") from None
        raise PartitionError(f"no tensor-parallel degree among {degrees} fits; with "
                             f"tensor_parallel={t}: {failed[t]}")
    if len(degrees) == 1:
        return plans[degrees[0]]
    ranked = sorted(plans.values(), key=lambda p: (p.iteration_time, p.tensor_parallel))
    best = ranked[0]
    others = [p.as_alternative(f"best with TP {p.tensor_parallel}") for p in ranked[1:]]
    unfit = (f"; TP {', '.join(map(str, sorted(failed)))} left out (TP {min(failed)}: "
             f"{failed[min(failed)]})" if failed else "")
    status = f"{best.solver.status}; TP degree chosen from {degrees} by simulated iteration{unfit}"
    solver = replace(best.solver, status=status, seconds=time.perf_counter() - start)
    return replace(best, alternatives=[*others, *best.alternatives], solver=solver)
