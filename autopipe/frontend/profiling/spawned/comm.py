"""What crossing between two ranks costs: a point-to-point micro-benchmark and its fit.

    prof = profile(model, inputs, chunks=8, comm=True)    # autopipe profile --comm
    prof.corrections.transfer, prof.corrections.stage_calls["distributed"]

[Note: measured transfer] (the cost model's side is [Note: transfer cost] in autopipe/core/transfer.py)
Two processes are spawned and joined by gloo (NCCL, one GPU each, when the profile is for CUDA
and two GPUs are there), each with one CPU thread (on a CPU, each pinned to its half of the
cores: [Note: ranks pinned to cores] in executor/ranks/rank_cores.py), as the distributed runtime's
ranks run:

- A ping-pong at each of ``COMM_SIZES``: rank 0 sends, rank 1 sends the same bytes back; half
  the median round trip is one crossing. :func:`fit_transfer` (comm_fit.py, with every fit
  below) fits ``latency + bytes / bandwidth`` to them, weighing relative errors alike (a
  least-squares line on absolute times would let the largest size decide the latency too).
- A late receive of the largest size: rank 1 sends, rank 0 posts its receive ``_LATE_MS``
  later; what that receive takes beyond the latency, over the same bytes' time on the wire,
  is ``comm_receive_share``: the receiving stage's share of a crossing ([Note: transfer cost]
  in autopipe/core/transfer.py; about 1 over gloo here: the bytes move only once the receive
  is posted).
- The distributed runtime's own cost per micro-batch: executor.DistributedPipeline over two
  near-EMPTY stages (one 1-element weight each), ``chunks`` micro-batches, GPipe. The simulator
  charges such a pipeline ``(M + 1) x (fwd + bwd call) + 2 M x latency`` for a training step and
  ``(M + 1) x fwd call + M x latency`` for a forward-only one (``eval_step``), so the two timed
  steps give the call costs (:func:`fit_call_ms` inverts the simulator itself for the first).
  The same empty pipeline under torch's 1F1B, whose every crossing sits on the critical path
  and which posts no receive ahead, costs more per micro-batch (about twice GPipe's on 2 gloo
  ranks sharing 2 cores): its fit is ``stage_call_1f1b_fwd_ms`` / ``_bwd_ms`` (split as
  GPipe's), which 1F1B plans pay ([Note: measured overheads] in autopipe/core/cost.py); and
  4 such stages, 2 per rank, under interleaved 1F1B give ``stage_call_interleaved1f1b_*``,
  and under each zero-bubble schedule (a V on the V schedules; each backward split, so 3 calls
  per stage and micro-batch) its own, where torch's schedule takes the chunks (else its plans
  pay the closest schedule's: [Note: zero-bubble calls] in autopipe/core/corrections.py). They describe this runtime (its schedule, PipelineStage's
  bookkeeping, posting and waiting for each message in Python), not executor.GPipe's: they go
  into ``corrections.stage_calls["distributed"]`` beside executor.GPipe's own, so one ``--comm``
  profile predicts either runtime ([Note: one profile, two runtimes] in autopipe/core/corrections.py).

On a CPU machine both ranks share the host: these numbers include the cores they compete for,
as the pipeline's own transfers do. An empty pipeline is nothing but messages, and in about half
the launches gloo's I/O thread takes more of each step ([Note: ranks pinned to cores] in
executor/ranks/rank_cores.py): its fitted call cost comes out near one of two values per launch,
and real pipelines run as the higher one predicts. So the ranks are launched ``COMM_LAUNCHES``
times: the crossings are the median launch's, each empty pipeline's step its slower launch's.
Measured: docs/benchmarks.md, "Measured vs predicted, two ranks"; the runs before and after this
choice, with their figures, are in CHANGELOG.md ("The call cost comes from the slower of two
launches").

Between two hosts, :func:`measure_comm_on_ranks` takes the same measurements on the two ranks
of a process group that a launcher made (``autopipe comm --nnodes 2``: torchrun on each host,
one rank each; autopipe/app/comm_job.py), one launch, fitted alike; ``autopipe profile
--comm-from FILE`` puts the saved result (:func:`load_comm`) into a profile through
:func:`with_comm`'s ``measured``. Ranks on two hosts share no cores, so no rank contention is
measured with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException, start_processes

from autopipe.errors import ProfileError, first_line
from autopipe.frontend.profiling.harness.one_weight import OneWeight
from autopipe.frontend.profiling.spawned.comm_fit import SCHEDULE_CALLS, empty_stages, fit_comm
from autopipe.frontend.profiling.spawned.ports import free_port
from executor.ranks.rank_cores import pin_local_rank
from executor.spec import check_schedule, stage_rank

if TYPE_CHECKING:  # the spawned ranks never load pandas
    from autopipe.core.profile_table import Profile

__all__ = ["COMM_LAUNCHES", "COMM_REPEATS", "COMM_SIZES", "load_comm", "measure_comm", "measure_comm_on_ranks",
           "timed_schedules", "with_comm"]

COMM_SIZES = (64, 64 << 10, 512 << 10, 4 << 20)  # bytes crossing one way
COMM_REPEATS = 20
EMPTY_STEPS = 30
COMM_LAUNCHES = 2  # the empty pipelines' steps are fitted from the slower launch
_WARMUP = 3
_LATE_MS = 5.0  # how long a receive is posted after its send


def _one_way_ms(x: torch.Tensor, rank: int, repeats: int) -> float:
    times = []
    for i in range(_WARMUP + repeats):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        if i >= _WARMUP:
            times.append((time.perf_counter() - t0) * 1e3 / 2)
    return statistics.median(times)


def _late_receive_ms(x: torch.Tensor, rank: int, repeats: int) -> float:
    """Rank 0's receive of ``x``, posted ``_LATE_MS`` after rank 1 posted its send: what the
    receiving end of a crossing costs when the message waited ([Note: transfer cost])."""
    times = []
    for i in range(_WARMUP + repeats):
        dist.barrier()
        if rank == 1:
            dist.send(x, 0)
            continue
        time.sleep(_LATE_MS / 1e3)
        t0 = time.perf_counter()
        dist.recv(x, 1)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        if i >= _WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) if times else 0.0


def timed_schedules(chunks: int) -> tuple[str, ...]:
    """The schedules of ``SCHEDULE_CALLS`` that torch runs on ``chunks`` micro-batches of
    :func:`empty_stages` stages (the others' plans pay the closest one's: [Note: zero-bubble
    calls] in autopipe/core/corrections.py)."""
    def runs(schedule: str) -> bool:
        try:
            check_schedule(schedule, empty_stages(schedule), 2, chunks)
        except ValueError:
            return False
        return True

    return tuple(s for s in SCHEDULE_CALLS if runs(s))


def _empty_pipeline_ms(rank: int, device: torch.device, chunks: int, steps: int) -> dict[str, float]:
    """Median ms of a 2-rank pipeline of near-empty stages: a training step under each schedule
    (:func:`empty_stages`, where torch takes the chunks), a GPipe forward-only step."""
    from executor.ranks.distributed import DistributedPipeline, infer_wires

    stages = [OneWeight().to(device) for _ in range(4)]
    x = torch.ones(chunks, 1, device=device)
    wires = {k: infer_wires(stages[:k], (x[:1],)) for k in (2, 4)}

    def pipeline(schedule: str) -> DistributedPipeline:
        k = empty_stages(schedule)
        mine = [s for s in range(k) if stage_rank(schedule, s, 2) == rank]
        return DistributedPipeline([stages[i] for i in mine], mine, k, loss_fn=lambda out, _: out.sum(),
                                   chunks=chunks, recompute="never", wires=wires[k], device=device,
                                   schedule=schedule)

    pipes = {s: pipeline(s) for s in ("gpipe", *timed_schedules(chunks))}
    target = torch.zeros(chunks, device=device)

    def median_ms(step: Any) -> float:
        times = []
        for i in range(_WARMUP + steps):
            t0 = time.perf_counter()
            step(x, target=target)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= _WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return {"fwd": median_ms(pipes["gpipe"].eval_step), **{s: median_ms(p.step) for s, p in pipes.items()}}


def _measure(rank: int, device: torch.device, sizes: Sequence[int], repeats: int, chunks: int,
             steps: int) -> dict[str, Any]:
    """This rank's side of [Note: measured transfer], in a process group of two."""
    _one_way_ms(torch.zeros(max(sizes) // 4 + 1, device=device), rank, 2)  # connect, warm up
    ms = [_one_way_ms(torch.zeros(max(n // 4, 1), dtype=torch.float32, device=device), rank, repeats)
          for n in sizes]
    late = _late_receive_ms(torch.zeros(max(sizes) // 4, device=device), rank, repeats)
    return {"ms": ms, "late": late, **_empty_pipeline_ms(rank, device, chunks, steps)}


def _rank(rank: int, port: int, out: str, backend: str, sizes: Sequence[int], repeats: int,
          chunks: int, steps: int) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cpu":  # as `autopipe run` places its ranks, before gloo starts its threads
        pin_local_rank(rank, 2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    try:
        measured = _measure(rank, device, sizes, repeats, chunks, steps)
        Path(out, f"{rank}.json").write_text(json.dumps(measured))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(backend: str, sizes: Sequence[int], repeats: int, chunks: int, steps: int) -> list[dict[str, Any]]:
    """Each of two freshly spawned ranks' measurements (``_rank``)."""
    port = free_port()  # [Note: a rendezvous port]
    with tempfile.TemporaryDirectory() as out:
        try:
            start_processes(_rank, args=(port, out, backend, list(sizes), repeats, chunks, steps),
                            nprocs=2, start_method="spawn")
        except Exception as err:  # noqa: BLE001 - a child's traceback: one line
            if isinstance(err, ProcessExitedException) or "bootstrapping phase" in str(err):
                # a rank died before measuring, or this IS a rank re-running the caller's script
                raise ProfileError(f"a measuring rank exited before it measured ({first_line(err)}); from a "
                                   "script, call this under `if __name__ == \"__main__\":` (the two ranks are "
                                   "spawned and import the script first), or profile without --comm") from None
            raise ProfileError(f"the 2-process transfer measurement failed ({str(err).strip().splitlines()[-1]}); "
                               "profile without --comm") from None
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]


def measure_comm(device: str | torch.device = "cpu", *, chunks: int = 8,
                 sizes: Sequence[int] = COMM_SIZES, repeats: int = COMM_REPEATS,
                 steps: int = EMPTY_STEPS, launches: int = COMM_LAUNCHES) -> dict[str, Any]:
    """The profile metadata of [Note: measured transfer]: two ranks spawned here ``launches``
    times (a few seconds each)."""
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    runs = [_launch(backend, sizes, repeats, chunks, steps) for _ in range(max(1, launches))]
    return fit_comm(runs, backend, sizes, chunks)


def measure_comm_on_ranks(*, chunks: int = 8, sizes: Sequence[int] = COMM_SIZES, repeats: int = COMM_REPEATS,
                          steps: int = EMPTY_STEPS) -> dict[str, Any]:
    """:func:`measure_comm`'s result, measured by the two ranks of this process's default group
    (on NCCL, each on its current CUDA device) instead of two spawned here: the link between
    two hosts when a torchrun launch put one rank on each (``autopipe comm --nnodes 2``). Every
    rank returns the same result, from its one launch."""
    if not dist.is_initialized() or dist.get_world_size() != 2:
        got = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise ProfileError(f"measure_comm_on_ranks needs a process group of 2 ranks, got {got}; launch "
                           "two ranks (torchrun --nproc_per_node 2, or --nnodes 2 with one per node)")
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = _measure(dist.get_rank(), device, sizes, repeats, chunks, steps)
    both: list[Any] = [None, None]
    dist.all_gather_object(both, mine)
    return fit_comm([both], backend, sizes, chunks)


_REQUIRED = ("comm_backend", "comm_latency_ms", "comm_bandwidth", "comm_receive_share", "stage_call_fwd_ms",
             "stage_call_bwd_ms")


def load_comm(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A measurement that :func:`measure_comm_on_ranks` made and ``autopipe comm`` saved, for
    :func:`with_comm`'s ``measured``; one line when the file is not one."""
    try:
        measured = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file; measure the link first: `autopipe comm --out {path}` "
                           "(with --nnodes 2 ... on each of the two hosts)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path} is not a link measurement ({first_line(err)}); re-run `autopipe comm "
                           f"--out {path} --force`") from None
    missing = [k for k in _REQUIRED if not isinstance(measured, dict) or k not in measured]
    if missing:
        raise ProfileError(f"{path} is not a link measurement of `autopipe comm`: it lacks {', '.join(missing)}; "
                           f"re-run `autopipe comm --out {path} --force`")
    return measured


def with_comm(profile: Profile, device: str | torch.device | None = None, *, model: nn.Module | None = None,
              example_inputs: Any = None, measured: dict[str, Any] | None = None, **kwargs: Any) -> Profile:
    """``profile`` with [Note: measured transfer]'s corrections, the step "transfer" of
    ``autopipe.profile`` (on the profiled device and chunks unless given): ``transfer`` and
    ``stage_calls["distributed"]``; the raw measurements (``comm_backend``, ``comm_ms``, ...)
    go into ``meta``. ``measured``: :func:`measure_comm`'s result, taken instead of measuring
    (a benchmark that reuses one measurement). With the profiled ``model`` and
    ``example_inputs`` (on a CPU), also how much slower a rank computes beside another
    ([Note: ranks sharing a host] in autopipe/frontend/profiling/spawned/rank_contention.py)."""
    from autopipe.core.corrections import Corrections, is_legacy_key
    from autopipe.frontend.profiling.spawned.rank_contention import with_rank_contention

    if model is not None and example_inputs is not None:
        profile = with_rank_contention(profile, model, example_inputs)
    if measured is None:
        kwargs.setdefault("chunks", int(profile.meta.get("chunks") or 8))
        where = device if device is not None else str(profile.meta.get("device_type") or "cpu")
        measured = measure_comm(where, **kwargs)
    ranks = Corrections.from_legacy_meta(measured)  # measure_comm's keys, as --comm profiles kept them
    corrections = dataclasses.replace(profile.corrections, transfer=ranks.transfer, stage_calls={
        **profile.corrections.stage_calls, "distributed": dict(ranks.stage_calls.get("distributed", {}))})
    meta = {**profile.meta, **{k: v for k, v in measured.items() if not is_legacy_key(k)}}
    return dataclasses.replace(profile, meta=meta, corrections=corrections)
