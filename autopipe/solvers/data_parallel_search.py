"""The replica count D: each divisor of the devices, a K = N / D stage pipeline each, by simulated
time per global batch ([Note: pipeline x data parallel] in autopipe/core/data_parallel.py).

``partition(..., devices=N, data_parallel="auto")`` runs the ordinary solver or search
([Note: automatic search] in autopipe/solvers/search.py) once per candidate D, on one replica's
N / D devices and ``batch_size / D`` rows, with the collectives of D replicas in the cost model,
and keeps the shortest simulated iteration. The replicas run at the same time, so one replica's
iteration is the time of the whole global batch. Each D's plan is the best its own search
found and the choice is the least of them, so ``"auto"`` is never slower (simulated) than any
D it tried; a D that does not fit in memory is left out. The plan's ``alternatives`` list the
best plan of every other D first, then the chosen D's own runners-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import measured_sizes
from autopipe.errors import PartitionError

__all__ = ["global_batch", "replica_counts", "search_replicas"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(profile: Profile, batch_size: int | None, data_parallel: int | str) -> int | None:
    """The global batch the replicas share: ``batch_size``, else the profile's. Replicas split
    it, so each plans a smaller micro-batch than the profile's: the profile must say its rows
    (``meta["micro_batch_size"]``) to be scaled ([Note: micro-batch scaling]); without them a
    fixed D plans the profile's micro-batch per replica as it is."""
    scalable = bool(measured_sizes(profile))
    if batch_size is not None and not scalable:
        raise PartitionError(f"data_parallel={data_parallel!r} splits batch_size={batch_size} over "
                             f"replicas, but the profile does not record its micro-batch rows "
                             f"(meta['micro_batch_size']) to scale to; re-run autopipe profile, "
                             f"or drop batch_size to plan the profile's micro-batch per replica")
    recorded = profile.meta.get("batch_size")
    batch = batch_size if batch_size is not None else (
        recorded if scalable and isinstance(recorded, int) and recorded >= 1 else None)
    if batch is None and data_parallel == "auto":
        raise PartitionError("data_parallel='auto' compares replica counts at one global batch: "
                             "pass batch_size=B (--batch-size B) with a profile that records its "
                             "micro-batch rows")
    return batch


def replica_counts(data_parallel: int | str, devices: int | None, batch: int | None,
                   chunks: Any) -> list[int]:
    """The replica counts to plan: every divisor of ``devices`` that splits ``batch`` into at
    least ``chunks`` rows per replica for ``"auto"``, else the given D after one-line checks."""
    fits = isinstance(chunks, int) and not isinstance(chunks, bool)
    if data_parallel == "auto":
        assert devices is not None and batch is not None
        out = [d for d in _divisors(devices)
               if batch % d == 0 and (not fits or batch // d >= chunks)]
        if not out:  # pragma: no cover - D = 1 always qualifies once chunks <= batch
            raise PartitionError(f"no replica count divides {devices} devices and batch {batch}")
        return out
    assert isinstance(data_parallel, int)
    if devices is not None and data_parallel > devices:
        raise PartitionError(f"data_parallel={data_parallel} > {devices} devices: each replica needs "
                             f"at least one; use data_parallel <= {devices}")
    if devices is not None and devices % data_parallel:
        raise PartitionError(f"data_parallel={data_parallel} does not divide the {devices} devices "
                             f"(K = N / D stages each); use one of {_divisors(devices)} or 'auto'")
    if batch is not None and batch % data_parallel:
        raise PartitionError(f"batch_size={batch} does not split evenly over data_parallel="
                             f"{data_parallel} replicas; use a multiple of {data_parallel}")
    if batch is not None and fits and batch // data_parallel < chunks:
        raise PartitionError(f"data_parallel={data_parallel} leaves {batch // data_parallel} rows of "
                             f"batch_size={batch} per replica, fewer than chunks={chunks}; use "
                             f"chunks <= {batch // data_parallel} or fewer replicas")
    return [data_parallel]


def search_replicas(counts: list[int], solve: Callable[[int], Plan]) -> Plan:
    """The fastest simulated plan among ``solve(D)`` for every D in ``counts``; ties go to the
    fewer stages. PartitionError (one line, the fewest replicas' reason) when none fits."""
    start = time.perf_counter()
    plans: dict[int, Plan] = {}
    failed: dict[int, PartitionError] = {}
    for d in counts:
        try:
            plans[d] = solve(d)
        except PartitionError as err:
            failed[d] = err
    if not plans:
        d = min(failed)
        if len(counts) == 1:
            raise PartitionError(f"data_parallel={d}: {failed[d]}; fewer replicas leave more "
                                 f"devices to each") from None
        raise PartitionError(f"no replica count among {counts} fits; with data_parallel={d}: "
                             f"{failed[d]}")
    if len(counts) == 1:
        return plans[counts[0]]
    ranked = sorted(plans.values(), key=lambda p: (p.iteration_time, p.num_stages))
    best = ranked[0]
    others = [p.as_alternative(f"best with {p.data_parallel} replica(s)") for p in ranked[1:]]
    unfit = f"; {', '.join(map(str, sorted(failed)))} do(es) not fit" if failed else ""
    status = (f"{best.solver.status}; replicas chosen from {counts} by simulated iteration"
              f"{unfit}")
    solver = replace(best.solver, status=status, seconds=time.perf_counter() - start)
    return replace(best, alternatives=[*others, *best.alternatives], solver=solver)
