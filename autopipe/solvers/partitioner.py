"""Balance a profile's layers into pipeline stages: ``autopipe.partition(profile, stages=K)``.

    search.py     the automatic search over stages, chunks, recomputation and schedule
    stage_dp.py   exact min-max split with a recompute mode per stage (memory, speeds, ties)
    fixed_config.py  one given configuration: the exact DP, the ILP where it can gain, a baseline
    dp.py         the DP for one configuration, and why nothing fits
    ilp.py        PuLP/CBC over the whole DAG, warm-started from the DP
    cbc_log.py    CBC's log read as it is written: bound, incumbent and gap, live
    baselines.py  equal layer counts, DeepSpeed's parameter balance, torchgpipe's blockpartition
    synthetic.py  deterministic chain / transformer-DAG profiles for tests and benchmarks

``autopipe.partition`` is the function, not this package: see [Note: functions named like
submodules] in autopipe/__init__.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopipe.core.corrections import RUNTIMES
from autopipe.core.cost import (
    DEFAULT_BANDWIDTH,
    DeviceSpec,
    LayerCosts,
    check_split,
    resolve_devices,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.data_parallel import check_data_parallel, replica_devices
from autopipe.core.estimated import sheet_memory
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import measured_sizes, profile_at, rows_for
from autopipe.core.tensor_parallel import at_degree, check_degree, check_sequence, degrees, tp_link
from autopipe.errors import PartitionError
from autopipe.solvers.data_parallel_search import global_batch, replica_counts, search_replicas
from autopipe.solvers.defaults import ILP_TIME_LIMIT, SEARCH_ILP_TIME_LIMIT
from autopipe.solvers.fixed_config import solve_fixed
from autopipe.solvers.search import search
from autopipe.solvers.search_space import Setting, chunk_candidates, stages_per_rank
from autopipe.solvers.tensor_parallel_search import host_size, search_degrees, tp_groups
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    RECOMPUTE_MODES,
    SCHEDULES,
    V_SCHEDULES,
    renamed_recompute,
    stage_rank,
)

__all__ = ["METHODS", "partition", "is_chain"]

METHODS: tuple[str, ...] = ("auto", "exact", "ilp", "step", "uniform", "params", "blockpartition")
METHOD_ALIASES = {"dp": "exact"}  # the exact solver's old name, in saved scripts and plans
MAX_AUTO_CHUNKS = 64  # chunks="auto" tries at most this many micro-batches


def is_chain(profile: Profile) -> bool:
    """True when every layer feeds only the next one (no branches, no skips)."""
    index = {name: i for i, name in enumerate(profile.layers)}
    return all(index[dst] == index[src] + 1 for src, dst, _ in profile.edges)


def partition(
    profile: Profile,
    *,
    stages: int | str | None = None,
    devices: Sequence[DeviceSpec | str] | int | None = None,
    method: str = "auto",
    chunks: int | str | None = None,
    recompute: str | Sequence[str] = "except_last",
    schedule: str = "gpipe",
    batch_size: int | None = None,
    memory_limit: int | str | None = None,
    optimizer: str = "adam",
    time_limit: float | None = None,
    ties: str = "share",
    bandwidth: float | str | None = "measured",
    progress: bool | None = None,
    max_chunks: int = MAX_AUTO_CHUNKS,
    data_parallel: int | str = 1,
    dp_mode: str = "ddp",
    runtime: str | None = None,
    checkpoint: str | Sequence[str] | None = None,  # recompute's old name, until the next release
    tensor_parallel: int | str = 1,
    devices_per_host: int | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """Split ``profile``'s layers into ``stages`` (or ``len(devices)``) balanced pipeline stages.

    Minimises the bottleneck stage time (forward + backward + recompute, over the device's
    relative speed, plus transfers at its cuts; see autopipe.core.cost) subject to each device's
    memory (``DeviceSpec.memory`` or ``memory_limit``, e.g. ``"16GiB"``), for the given
    ``chunks``, ``recompute`` (one mode, or a list with one per stage) and ``schedule``
    (``gpipe``, ``1f1b``, ``interleaved1f1b`` and ``interleaved_zb``: stage s on device s %
    ranks, ``zbv`` and ``dualpipev``: two stages per rank in a V, rank r running stages r and
    2W-1-r; the last three split each backward into input and weight gradients, which needs a
    profile that measured the split: [Note: zero-bubble schedules] in executor/spec.py).

    Any of ``stages``, ``chunks``, ``recompute``, ``schedule`` may be ``"auto"``: the plan is
    then the configuration with the shortest SIMULATED iteration that fits memory ([Note:
    automatic search] in autopipe/solvers/search.py): ``stages="auto"`` tries 1 .. len(devices)
    devices (``devices`` required; the multi-stage schedules run two stages on each),
    ``chunks="auto"``
    the divisors of ``batch_size`` (default: the profile's) up to ``max_chunks``, with the
    profile scaled to each micro-batch ([Note: micro-batch scaling]), ``recompute="auto"`` a
    mode per stage, ``schedule="auto"`` each schedule. ``plan.explain()`` then lists the next
    best alternatives. ``batch_size`` with a fixed ``chunks`` plans micro-batches of
    ``ceil(batch_size / chunks)`` rows.

    method: ``exact`` (the min-max DP, exact over the topological order; ``dp`` is an alias),
    ``ilp`` (exact over the DAG, PuLP/CBC warm-started from the DP, bounded by ``time_limit``
    seconds of CBC, default 5, in a search 2; the progress line shows it), ``auto`` (the DP,
    then the ILP only where it can gain: not when the order is the DAG's only one, nor when the
    DP is within the ILP's gap of a lower bound on every DAG split, [Note: when the ILP can
    gain] in autopipe/solvers/dag_bound.py; the DP split is kept unless the ILP beats it in
    time; then the ``step`` split where it steps faster or its search was not exhaustive;
    ``plan.solver`` says which ran, its status, bound and gap), ``step`` (the split with the
    shortest simulated step of the plan's own schedule rather than the smallest slowest stage:
    every split of the layer order where they can all be bounded, else a descent from the DP's
    and the baselines' splits, its gap to a bound stated in ``plan.solver``; one configuration
    only: [Note: the step, not the bottleneck] in autopipe/solvers/step_split.py), or a baseline:
    ``uniform``, ``params``, ``blockpartition`` (torchgpipe). ``ties``: ``share`` charges a tied parameter to every stage using it,
    ``colocate`` keeps each tie group on one stage. ``bandwidth`` in bytes/s between
    neighbouring stages (None or 0: free; ``"measured"``, the default: the profile's own from
    ``autopipe profile --comm``, else 1e10, [Note: transfer cost] in autopipe/core/transfer.py). ``chunks`` defaults to the number of micro-batches
    the profile was measured for (its ``meta["chunks"]``), else 8: the plan's fingerprint is the
    profiled micro-batch's, so that is the pipeline it fits. Given ``stages`` and no ``devices``,
    each stage gets its own device of the kind the profile was measured on (``cpu:0``,
    ``cpu:1``, ...; ``stage0``, ... when the profile does not say), or under
    a multi-stage schedule every two stages share one (``cpu:0, cpu:1, cpu:0, cpu:1``; in a V
    ``cpu:0, cpu:1, cpu:1, cpu:0``). ``progress``: the search's
    and the ILP's progress on stderr; None (default) shows it when stderr is a terminal, True
    always, False never. ``devices=N``: N devices of the profiled kind; under ``zbv`` or
    ``dualpipev`` without ``stages``, devices that name each rank once are the ranks, two stages
    each in the V (``devices=2``: 4 stages, ``cpu:0, cpu:1, cpu:1, cpu:0``). ``data_parallel=D``
    runs D replicas of a pipeline on N / D devices each, every replica on ``batch_size / D``
    rows of the global ``batch_size`` (default: the profile's), their gradients synced as
    ``dp_mode`` says (``ddp``: all-reduce, ``fsdp``: sharded state); ``data_parallel="auto"``
    tries every divisor D of N by simulated time per global batch ([Note: pipeline x data
    parallel] in autopipe/core/data_parallel.py, autopipe/solvers/data_parallel_search.py).
    ``runtime``: whose measured costs to plan with, ``"gpipe"`` (executor.GPipe in one process)
    or ``"distributed"`` (torch.distributed.pipelining: its call costs, the transfer and the
    ranks' slowdown); default: the distributed one where the profile measured it, else gpipe
    ([Note: one profile, two runtimes] in autopipe/core/corrections.py); ``plan.runtime``
    records it. ``tensor_parallel=t`` splits each stage's layers over t ranks of one host,
    Megatron's column / row pairs and vocabulary as the profile's ``tp_role`` column says, on
    ``devices = PP x TP x DP`` (each t consecutive devices one TP group, inside a host of
    ``devices_per_host``, default 8 for a profile estimated on a GPU sheet, else all one host);
    ``"auto"`` tries every degree that divides the devices, the host and the heads ([Note: the
    mesh] in autopipe/solvers/tensor_parallel_search.py, [Note: tensor-parallel cost] in
    autopipe/core/tensor_parallel.py); ``plan.tensor_parallel`` records it. ``sequence_parallel=True`` also splits the layers
    between the groups (norms, residual adds: the profile's ``sequence`` layers) by tokens over
    each TP group ([Note: sequence parallelism]); ``plan.sequence_parallel`` records it. A profile estimated on a device sheet limits every device to the sheet's memory
    unless ``memory_limit`` says otherwise (a DeviceSpec's own memory still binds where it is
    less). Raises PartitionError when no split fits.
    """
    recompute = renamed_recompute(recompute, checkpoint, "partition")
    if not isinstance(profile, Profile):
        raise PartitionError(f"partition needs an autopipe.Profile, got {type(profile).__name__}; "
                             f"load one with autopipe.Profile.load(path)")
    if method not in METHODS and method not in METHOD_ALIASES:
        raise PartitionError(f"method={method!r} is unknown; choose one of {list(METHODS)}")
    method = METHOD_ALIASES.get(method, method)
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, int | float)
                                   or not time_limit > 0):
        raise PartitionError(f"time_limit={time_limit!r}: need the ILP's seconds > 0 (None: "
                             f"{ILP_TIME_LIMIT:g} s, in a search {SEARCH_ILP_TIME_LIMIT:g} s)")
    if progress is not None and not isinstance(progress, bool):
        raise PartitionError(f"progress must be True, False or None (shown when stderr is a "
                             f"terminal), got {progress!r}")
    _check_choices(stages, chunks, recompute, schedule, batch_size, max_chunks)
    if runtime is not None and runtime not in RUNTIMES:
        raise PartitionError(f"runtime={runtime!r} is unknown; use one of {list(RUNTIMES)} (gpipe: executor.GPipe "
                             "in one process, distributed: torch.distributed.pipelining), or None: the profile's")
    profile = profile.for_runtime(runtime)  # every cost below is this runtime's
    if memory_limit is None:  # an estimated profile's devices: the sheet's ([Note: estimated or measured])
        memory_limit = sheet_memory(profile.meta)
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise PartitionError(f"devices={devices}: need at least one device, or a list of names")
        kind = profile.meta.get("device_type")
        devices = [f"{kind}:{i}" if kind else f"stage{i}" for i in range(devices)]
    if chunks is None:
        chunks = int(profile.meta.get("chunks") or 8)
    if isinstance(bandwidth, str):
        if bandwidth != "measured":
            raise PartitionError(f"bandwidth={bandwidth!r}: give bytes/s, 0 or None (free), or "
                                 f"'measured' (the profile's, from autopipe profile --comm)")
        bandwidth = LayerCosts.from_profile(profile).comm_bandwidth or DEFAULT_BANDWIDTH
    args: dict[str, Any] = dict(
        stages=stages, devices=devices, method=method, chunks=chunks, recompute=recompute,
        schedule=schedule, batch_size=batch_size, memory_limit=memory_limit, optimizer=optimizer,
        time_limit=time_limit, ties=ties, bandwidth=bandwidth, progress=progress,
        max_chunks=max_chunks)
    if tensor_parallel != 1:
        return _tensor_parallel(profile, tensor_parallel, devices_per_host, data_parallel, dp_mode, args,
                                sequence_parallel)
    check_sequence(profile, sequence_parallel, 1)
    host_size(profile, devices_per_host, None)  # one line for a bad host size
    return _replicas_or_one(profile, data_parallel, dp_mode, args)


def _replicas_or_one(profile: Profile, data_parallel: int | str, dp_mode: str, args: dict[str, Any]) -> Plan:
    if data_parallel != 1:
        return _replicated(profile, data_parallel, dp_mode, args)
    check_data_parallel(data_parallel, dp_mode)
    return _pipeline(profile, **args, data_parallel=1, dp_mode=dp_mode)


def _tensor_parallel(profile: Profile, tensor_parallel: int | str, devices_per_host: int | None,
                     data_parallel: int | str, dp_mode: str, args: dict[str, Any], sequence: bool) -> Plan:
    """Each stage over a TP group of t devices, or the fastest t ([Note: the mesh]), split by
    tokens too where ``sequence`` ([Note: sequence parallelism])."""
    devices = args["devices"]
    pool = None if devices is None else resolve_devices(None, devices, args["memory_limit"])
    n = None if pool is None else len(pool)
    host = host_size(profile, devices_per_host, n)
    if tensor_parallel == "auto":
        if n is None:
            raise PartitionError("tensor_parallel='auto' chooses how many devices split each stage: "
                                 "pass devices=N (--devices N or names)")
        counts = degrees(profile, n, host)
    else:
        check_degree(profile, tensor_parallel, n, host)
        counts = [int(tensor_parallel)]
    check_sequence(profile, sequence, max(counts))
    link = tp_link(profile, args["bandwidth"])

    def solve(t: int) -> Plan:
        sub = {**args, "devices": None if pool is None else tp_groups(pool, t)}
        return _replicas_or_one(at_degree(profile, t, link, sequence), data_parallel, dp_mode, sub)

    return search_degrees(counts, solve, sequence)


def _replicated(profile: Profile, data_parallel: int | str, dp_mode: str, args: dict[str, Any]) -> Plan:
    """D replicas of a pipeline, or the fastest D: see autopipe/solvers/data_parallel_search.py."""
    check_data_parallel(1 if data_parallel == "auto" else data_parallel, dp_mode)
    devices = args["devices"]
    pool = None if devices is None else resolve_devices(None, devices, args["memory_limit"])
    if pool is None and (data_parallel == "auto" or not isinstance(args["stages"], int)):
        raise PartitionError(f"data_parallel={data_parallel!r} shares devices among replicas: pass "
                             f"devices=N (--devices N or names), or stages=K with data_parallel=D")
    stages = args["stages"]
    if data_parallel == "auto" and isinstance(stages, int):
        raise PartitionError(f"data_parallel='auto' sets each replica's stages (N / D): drop "
                             f"stages={stages} or pass stages='auto', or give data_parallel=D "
                             f"with D x {stages} = the number of devices")
    batch = global_batch(profile, args["batch_size"], data_parallel)
    counts = replica_counts(data_parallel, None if pool is None else len(pool), batch, args["chunks"])
    per_rank = max(_stages_a_rank(args["schedule"]))
    ranks = stages // per_rank if isinstance(stages, int) else stages  # the fewest it could take
    if isinstance(ranks, int) and pool is not None and ranks > len(pool) // counts[0]:
        raise PartitionError(f"stages={stages} with data_parallel={counts[0]} needs "
                             f"{counts[0] * ranks} devices, got {len(pool)}; give more devices or "
                             f"stages <= {per_rank * (len(pool) // counts[0])}")

    def solve(d: int) -> Plan:
        replica = {"devices": None if pool is None else replica_devices(pool, d),
                   "batch_size": None if batch is None else batch // d}
        return _pipeline(profile, **{**args, **replica}, data_parallel=d, dp_mode=dp_mode)

    return search_replicas(counts, solve)


def _stages_a_rank(schedule: str) -> set[int]:
    """How many stages a rank may run under ``schedule`` (under "auto": any schedule's)."""
    return {stages_per_rank(s) for s in (SCHEDULES if schedule == "auto" else [schedule])}


def _placed(devices: Sequence[DeviceSpec | str], stages: int | None, schedule: str) -> list[DeviceSpec | str]:
    """Ranks named once each (``devices=4``, ``["cuda:0", "cuda:1"]``) under a schedule that runs
    several stages a rank: each rank's device given to its stages as the runtime places them
    (``executor.spec.stage_rank``), ``stages`` of them (a V schedule: two a rank when not given).
    Devices that already name a rank twice, or a count they do not divide, are left as given
    (checked with the schedule)."""
    def name(d: DeviceSpec | str) -> str:
        return d if isinstance(d, str) else d.name

    count = stages if stages is not None else (2 * len(devices) if schedule in V_SCHEDULES else len(devices))
    if len({name(d) for d in devices}) < len(devices) or count % len(devices):
        return list(devices)
    return [devices[stage_rank(schedule, s, len(devices))] for s in range(count)]


def _pipeline(profile: Profile, *, stages: int | str | None,
              devices: Sequence[DeviceSpec | str] | None, method: str, chunks: int | str,
              recompute: str | Sequence[str], schedule: str, batch_size: int | None,
              memory_limit: int | str | None, optimizer: str, time_limit: float | None, ties: str,
              bandwidth: float | None, progress: bool | None, max_chunks: int,
              data_parallel: int, dp_mode: str) -> Plan:
    """One replica's pipeline (all of it when ``data_parallel`` is 1): a search or one solve."""
    if batch_size is None and chunks == "auto":
        batch_size = _int(profile.meta.get("batch_size"))
        if batch_size is None:
            raise PartitionError("chunks='auto' needs the mini-batch size: pass batch_size=B "
                                 "(--batch-size B); the profile does not record one")
    if isinstance(chunks, int) and batch_size is not None and chunks > batch_size:
        raise PartitionError(f"chunks={chunks} > batch_size={batch_size}: micro-batches would be "
                             f"empty; use chunks <= {batch_size}")
    kind = profile.meta.get("device_type")
    searching = "auto" in (stages, chunks, recompute, schedule)
    if devices is None and isinstance(stages, int) and not isinstance(stages, bool) and stages > 0:
        if schedule in MULTI_STAGE_SCHEDULES and not searching:  # two stages a rank, as the runtime
            per_rank = stages_per_rank(schedule)
            if stages % per_rank:
                raise PartitionError(f"schedule={schedule!r} runs {per_rank} stages on "
                                     f"each rank: give an even stages (not {stages}) or "
                                     f"devices=[...] with the ranks' devices as it places them")
            ranks = stages // per_rank
            devices = [f"{kind or 'rank'}:{stage_rank(schedule, s, ranks)}" for s in range(stages)]
        elif kind:
            devices = [f"{kind}:{s}" for s in range(stages)]  # one device of the profiled kind each
    if devices is not None and schedule in MULTI_STAGE_SCHEDULES and not searching:
        devices = _placed(devices, stages if isinstance(stages, int) else None, schedule)  # a search lays out the pool's ranks itself
    if searching:
        if method in ("step", "uniform", "params", "blockpartition"):
            raise PartitionError(f"method={method!r} splits one given configuration; with 'auto' "
                                 f"choices use method='auto', 'exact' or 'ilp'")
        return _search(profile, stages, devices, chunks, recompute, schedule, batch_size,
                       memory_limit, optimizer, ties, bandwidth, method, time_limit, progress,
                       max_chunks, data_parallel, dp_mode)
    assert isinstance(chunks, int) and isinstance(stages, int | None)
    if batch_size is not None and measured_sizes(profile):
        profile = profile_at(profile, rows_for(batch_size, chunks), batch_size=batch_size, chunks=chunks)
    return solve_fixed(profile, stages, devices, chunks, recompute, schedule, memory_limit, optimizer,
                       ties, bandwidth, method, ILP_TIME_LIMIT if time_limit is None else time_limit,
                       progress, data_parallel, dp_mode)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _check_choices(stages: Any, chunks: Any, recompute: Any, schedule: Any, batch_size: Any,
                   max_chunks: Any) -> None:
    """One line for each bad value, before any work."""
    if stages is not None and stages != "auto" and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise PartitionError(f"stages={stages!r}: need an integer K >= 1 or 'auto'")
    if chunks is not None and chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise PartitionError(f"chunks={chunks!r}: need an integer number of micro-batches >= 1 or 'auto'")
    if not (recompute == "auto" or (isinstance(recompute, str) and recompute in RECOMPUTE_MODES)
            or (isinstance(recompute, list | tuple) and recompute
                and all(isinstance(c, str) and c in RECOMPUTE_MODES for c in recompute))):
        raise PartitionError(f"recompute={recompute!r}: choose one of {list(RECOMPUTE_MODES)}, "
                             f"a list with one per stage, or 'auto'")
    if schedule != "auto" and schedule not in SCHEDULES:
        raise PartitionError(f"schedule={schedule!r}: choose one of {list(SCHEDULES)} or 'auto'")
    if batch_size is not None and _int(batch_size) is None:
        raise PartitionError(f"batch_size={batch_size!r}: need an integer number of rows >= 1")
    if _int(max_chunks) is None:
        raise PartitionError(f"max_chunks={max_chunks!r}: need an integer >= 1")


def _search(profile: Profile, stages: int | str | None, devices: Sequence[DeviceSpec | str] | None,
            chunks: int | str, recompute: str | Sequence[str], schedule: str,
            batch_size: int | None, memory_limit: int | str | None, optimizer: str, ties: str,
            bandwidth: float | None, method: str, time_limit: float | None,
            progress: bool | None, max_chunks: int, data_parallel: int, dp_mode: str) -> Plan:
    if devices is None:
        if stages == "auto":
            raise PartitionError("stages='auto' chooses up to one stage per device: pass "
                                 "devices=[...] (--devices N or names) to say how many there are")
        devices = [f"stage{s}" for s in range(int(stages or 0))] if stages else None
    pool = resolve_devices(None, devices, memory_limit)
    if schedule != "auto":  # "auto" leaves out what it cannot plan, and explain() says why
        check_split(LayerCosts.from_profile(profile), schedule)
    if schedule in MULTI_STAGE_SCHEDULES and len({d.name for d in pool}) < len(pool):
        raise PartitionError(f"a search takes devices as the pool to choose ranks from, each "
                             f"listed once; {schedule} then runs two stages on each")
    per_rank = _stages_a_rank(schedule)
    if isinstance(stages, int) and not any(stages % p == 0 and stages // p <= len(pool) for p in per_rank):
        most = [f"{'an even ' * (p > 1)}stages <= {p * len(pool)}" for p in sorted(per_rank)]  # p a rank
        raise PartitionError(f"stages={stages} but only {len(pool)} devices given; use {', '.join(most)} or 'auto'")
    ranks = list(range(1, len(pool) + 1)) if stages == "auto" else [int(stages or len(pool))]
    if isinstance(chunks, int):
        counts = [chunks]
    else:
        assert batch_size is not None
        counts = chunk_candidates(batch_size, max_chunks)
    modes: list[str | tuple[str, ...]] = [recompute if isinstance(recompute, str) else tuple(recompute)]
    setting = Setting(ranks, counts, list(SCHEDULES) if schedule == "auto" else [schedule], modes,
                      batch_size, optimizer, bandwidth, ties,
                      stages=stages if isinstance(stages, int) else None,
                      data_parallel=data_parallel, dp_mode=dp_mode)
    CostOptions(counts[0], "never", optimizer, bandwidth, ties)  # one line for a bad option
    return search(profile, pool, setting, method=method, time_limit=time_limit, progress=progress)
