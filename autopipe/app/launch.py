"""``autopipe run MODEL --nproc K``: train a model as a K-process pipeline via torchrun.

    autopipe run mlp --plan plans/mlp.json --nproc 2 --steps 20
    autopipe run mlp --nproc 4 --data-parallel 2     # 2 replicas x 2 stages, 16 rows each

With ``--data-parallel D`` the ``--nproc`` ranks run D replicas of a pipeline of nproc / D ranks
(autopipe.distributed_pipeline's ``data_parallel``), each on its own batch / D rows of the
``--batch-size`` rows; ``auto`` without ``--plan`` lets the planner pick D for that batch.

First, in this process, everything that can be checked without the ranks is checked (the plan
against the rank count and the traced model, the batch against the chunks, the rank count
against the layers) and, without ``--plan``, the model is profiled and partitioned here; each
rank's layers are printed. Then ``python -m torch.distributed.run --standalone
--nproc_per_node K -m autopipe.app.rank_main --config JSON`` runs the ranks (torchrun picks a
free port and, when one rank fails, stops the others).

[Note: one line from K ranks] A failing pipeline makes every rank and torchrun itself print a
traceback (41-168 lines for two ranks). The ranks' stderr and torchrun's own go to files in a
log directory instead (``--redirects 2`` keeps the ranks' stdout, the losses, on the
terminal), and the launcher reads them back: a rank's one-line error (rank_main prints one per
AutopipeError / ExecutorError), the ``PipelineFailure`` of a rank whose peer died or hung, and
torchrun's "root cause" (which rank exited first, with which code or signal) become ONE line
naming the rank, the peer and the step, with the log directory; the status is 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from autopipe.app.config import (
    DEFAULT_BATCH,
    DEFAULT_CHUNKS,
    Checkpoint,
    RunConfig,
    Schedule,
    resolve,
)
from autopipe.app.model_spec import load_model
from autopipe.assemble_mesh import replicas_of
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from executor.spec import MULTI_STAGE_SCHEDULES, check_schedule

__all__ = ["RankFailure", "prepare", "torchrun_command", "run", "diagnose"]

TIMEOUT_EXIT = 124


class RankFailure(BuildError):
    """A rank of ``autopipe run`` failed; the message is the one line that says which and why."""


def _stages_per_rank(config: RunConfig) -> int:
    return 2 if config.schedule in MULTI_STAGE_SCHEDULES else 1


def _check_ranks(config: RunConfig, plan: Plan | None, chunks: int, batch: int, replicas: int = 1) -> int:
    """The number of stages, after checking ranks, plan, chunks and batch agree (one line each)."""
    w = config.nproc // replicas  # ranks of one pipeline
    if batch % replicas:
        raise BuildError(f"--batch-size {batch} does not split into --data-parallel {replicas} "
                         f"replicas; use a multiple of {replicas}")
    batch //= replicas  # each replica's rows
    if plan is not None:
        k = plan.num_stages
        if config.schedule in MULTI_STAGE_SCHEDULES and k % w:
            raise BuildError(f"the plan has {k} stages, which {w} ranks cannot share equally (--schedule "
                             f"{config.schedule} gives each rank the same number); pass --nproc a divisor "
                             f"of {k}, or re-run `autopipe partition --stages {2 * w}`")
        if config.schedule not in MULTI_STAGE_SCHEDULES and k != w:
            per = f" / {replicas} replicas" if replicas > 1 else ""
            raise BuildError(f"the plan has {k} stages but --nproc {config.nproc}{per} starts {w} ranks of "
                             f"one stage each; pass --nproc {k * replicas}, or re-run `autopipe "
                             f"partition --stages {w}` for {w} ranks")
    else:
        k = w * _stages_per_rank(config)
    if batch % chunks:
        lower, upper = batch // chunks * chunks, (batch // chunks + 1) * chunks
        fits = f"{lower} or {upper}" if lower else str(upper)
        if replicas > 1:
            fits = f"{lower * replicas} or {upper * replicas}" if lower else str(upper * replicas)
        what = f"{batch} rows per replica" if replicas > 1 else f"--batch-size {batch}"
        raise BuildError(f"{what} is not a multiple of --chunks {chunks}: the ranks pass "
                         f"equal micro-batches; use --batch-size {fits}")
    rounds = max(1, chunks // w)
    if config.schedule in ("interleaved1f1b", "interleaved_zb") and chunks % rounds:
        raise BuildError(f"--schedule {config.schedule} needs --chunks a multiple of its rounds "
                         f"(chunks // nproc = {rounds}); use --chunks {w * rounds} or another multiple of {w}")
    try:  # what the schedule's torch class accepts (executor.spec)
        check_schedule(config.schedule or "gpipe", k, w, chunks)
    except ValueError as err:
        raise BuildError(f"--schedule {config.schedule}: {err}") from None
    return k


def prepare(config: RunConfig, work_dir: str | os.PathLike[str]) -> tuple[RunConfig, Plan, str]:
    """Check ``config`` against its plan and model before any rank starts, and resolve it.

    Returns the config every rank reads (plan path, chunks, batch and checkpoint filled in), the
    plan, and where the plan came from. Without ``config.plan`` the model is profiled (with
    ``config.threads`` threads, as a rank runs) and partitioned here, into ``work_dir/plan.json``.
    """
    import torch

    from autopipe.assemble import microbatch_inputs
    from autopipe.frontend.tracing.graph import trace

    config.check()
    plan = Plan.load(config.plan) if config.plan else None
    # one schedule from here on: the flag's, else the plan's, else gpipe
    config = dataclasses.replace(config, schedule=config.schedule or cast(Schedule, plan.schedule if plan else "gpipe"))
    chunks = resolve(config.chunks, plan.chunks if plan else None, default=DEFAULT_CHUNKS)
    batch = resolve(config.batch_size, plan.batch_size if plan else None, default=DEFAULT_BATCH)
    checkpoint = config.checkpoint or cast(Checkpoint, plan.checkpoint if plan else "except_last")
    asked = config.replicas()
    auto = asked == "auto" and plan is None  # the planner picks D below
    replicas, dp_mode = (1, config.dp_mode or "ddp") if auto else replicas_of(plan, asked, config.dp_mode,
                                                                              config.nproc)
    k = _check_ranks(config, plan, chunks, batch, replicas)
    loaded = load_model(config.model, batch // replicas, for_training="autopipe run")
    micro = microbatch_inputs(loaded.inputs, chunks)
    graph = trace(loaded.model, micro)
    if len(graph.layers) < k:
        per = f" ({_stages_per_rank(config)} per rank with --schedule {config.schedule})" if k > config.nproc else ""
        raise BuildError(f"--nproc {config.nproc} needs {k} stages{per} of at least one layer each, but "
                         f"{config.model} traces to {len(graph.layers)} layers; use --nproc "
                         f"{len(graph.layers) // _stages_per_rank(config)} or fewer")
    if plan is not None:
        plan.check(graph.layers, graph.fingerprint, micro_batch_size=math.ceil(batch // replicas / chunks))
        where = str(config.plan)
    else:
        from autopipe.app.profile_job import _loss_of
        from autopipe.frontend.profiling.profiler import profile
        from autopipe.solvers.partitioner import partition

        before = torch.get_num_threads()
        torch.set_num_threads(config.threads)
        try:
            prof = profile(loaded.model, loaded.inputs, chunks=chunks, graph=graph, name=loaded.name,
                           progress=False, host_allocator=config.host_allocator,
                           precision=config.precision,
                           **_loss_of(loaded))  # [Note: the loss in the last stage]
        finally:
            torch.set_num_threads(before)
        if replicas == 1 and not auto:
            plan = partition(prof, devices=[f"rank{s % config.nproc}" for s in range(k)], chunks=chunks,
                             checkpoint=checkpoint, runtime="distributed")
        else:  # [Note: pipeline x data parallel]: replicas of batch / D rows on the nproc ranks
            plan = partition(prof, devices=[f"rank{r}" for r in range(config.nproc)], chunks=chunks,
                             checkpoint=checkpoint, batch_size=batch, stages=None if auto else k,
                             data_parallel="auto" if auto else replicas, dp_mode=dp_mode, runtime="distributed")
            replicas = plan.data_parallel
            _check_ranks(config, plan, chunks, batch, replicas)
        where = str(plan.save(Path(work_dir) / "plan.json"))
    resolved = dataclasses.replace(config, plan=where, chunks=chunks, batch_size=batch, checkpoint=checkpoint,
                                   data_parallel=str(replicas), dp_mode=cast(Any, dp_mode))
    return resolved, plan, where


def layout(config: RunConfig, plan: Plan, where: str) -> str:
    """Which layers each rank runs, with the plan's predicted time per micro-batch."""
    d = int(config.data_parallel or 1)
    w = config.nproc // d
    micro = math.ceil((config.batch_size or 1) // d / (config.chunks or 1))
    spans = plan.spans()
    wide = max(len("first .. last"), *(len(x) for x in spans))
    each = f"{d} replicas ({config.dp_mode}) of {config.batch_size // d if config.batch_size else 1} rows, " if d > 1 else ""
    ranks = [",".join(str(s % w + r * w) for r in range(d)) for s in range(len(plan.stages))]
    rw = max(4, *(len(x) for x in ranks))
    amp = "" if config.precision == "fp32" else f", precision={config.precision}"
    lines = [f"{config.model} on {config.nproc} ranks ({config.schedule}, checkpoint={config.checkpoint}{amp}): "
             f"batch {config.batch_size} {'as ' + each if each else ''}in {config.chunks} micro-batches of "
             f"{micro} rows; plan {where}",
             f"{'rank':>{rw}}  {'stage':>5}  {'layers':>6}  {'first .. last':<{wide}}  {'ms per micro-batch':>18}"]
    for s, names in enumerate(plan.stages):
        lines.append(f"{ranks[s]:>{rw}}  {s:>5}  {len(names):>6}  {spans[s]:<{wide}}  "
                     f"{plan.stage_times[s]:>18.3f}")
    return "\n".join(lines)


def torchrun_command(config: RunConfig, log_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The torchrun command line that runs ``config`` on ``config.nproc`` local processes; with
    ``log_dir``, the ranks' stderr goes to files there ([Note: one line from K ranks])."""
    config.check()
    logs = ["--log-dir", str(log_dir), "--redirects", "2"] if log_dir is not None else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={config.nproc}", *logs, "-m", "autopipe.app.rank_main",
            "--config", config.to_json()]


def run(
    config: RunConfig,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float | None = None,
    log: bool = True,
) -> int:
    """Check, plan and run ``config`` under torchrun; 0 when every rank finished.

    Raises RankFailure (one line) when a rank fails, after stopping the others; the ranks' and
    torchrun's logs stay in ``log_dir`` (default: a new ``autopipe-run-*`` temporary directory).
    Returns 124 when ``timeout`` seconds pass first.
    """
    work = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="autopipe-run-"))
    work.mkdir(parents=True, exist_ok=True)
    resolved, plan, where = prepare(config, work)
    if log:
        print(layout(resolved, plan, where), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), **(extra_env or {})}
    ranks_dir = work / "torchrun"
    with open(work / "torchrun.log", "w", encoding="utf-8") as own:
        proc = subprocess.Popen(torchrun_command(resolved, ranks_dir), env=env, stderr=own)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            print(f"autopipe run: no result after {timeout:.0f}s; stopped torchrun (logs in {work})",
                  file=sys.stderr)
            return TIMEOUT_EXIT
        except BaseException:  # Ctrl-C: do not leave the ranks running
            _stop(proc)
            raise
    logs = _collect(ranks_dir, work, config.nproc)
    if code == 0:
        _echo_warnings(logs, work)
        return 0
    raise RankFailure(diagnose(logs, (work / "torchrun.log").read_text(encoding="utf-8", errors="replace"),
                               config.nproc, work))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _collect(ranks_dir: Path, work: Path, world: int) -> dict[int, str]:
    """Each rank's stderr, copied to ``work/rankN.log`` (torchrun nests it in run/attempt dirs)."""
    logs: dict[int, str] = {}
    for path in sorted(ranks_dir.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime):
        if path.parent.name.isdigit():
            logs[int(path.parent.name)] = path.read_text(encoding="utf-8", errors="replace")
    for rank in range(world):
        (work / f"rank{rank}.log").write_text(logs.get(rank, ""), encoding="utf-8")
    return logs


def _echo_warnings(logs: dict[int, str], work: Path, most: int = 8) -> None:
    """A successful run's stderr lines (warnings), each once, at most ``most`` of them."""
    seen: list[str] = []
    for rank in sorted(logs):
        for line in logs[rank].splitlines():
            if line.strip() and line not in seen:
                seen.append(line)
    for line in seen[:most]:
        print(line, file=sys.stderr)
    if len(seen) > most:
        print(f"autopipe run: {len(seen) - most} more line(s) of the ranks' stderr in {work}", file=sys.stderr)


@dataclass(frozen=True)
class _Exit:
    rank: int
    code: int


_RANK_ERROR = re.compile(r"^autopipe run: error on rank (\d+)(?: at step (\d+))?: (.*)$", re.M)
_PIPELINE_FAILURE = re.compile(
    r"^PipelineFailure: rank (\d+)/\d+(?: \([^)]*\))?: pipeline step (\d+) \(([^,]+),[^)]*\) failed: .*?\((.*)\); "
    r"see that rank's log$", re.M)
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _last_error(text: str) -> str | None:
    """The last ``SomeError: message`` line of a traceback."""
    hits = re.findall(r"^(\w+(?:\.\w+)*(?:Error|Exception|Failure|Interrupt)\b.*)$", text, re.M)
    return hits[-1].strip()[:300] if hits else None


def diagnose(logs: dict[int, str], torchrun_log: str, world: int, work: Path) -> str:
    """ONE line from the ranks' stderr and torchrun's: which rank failed, at which step, which
    peer died or hung when that is known, and where the logs are ([Note: one line from K ranks])."""
    where = f"the ranks' logs are in {work}"
    root = _ROOT.search(torchrun_log)
    first = _Exit(int(root.group(1)), int(root.group(2))) if root else None
    errors = {int(m.group(1)): m for text in logs.values() for m in _RANK_ERROR.finditer(text)}
    if errors:  # a rank's own one-line error: bad input or a runtime check, the root cause
        rank = first.rank if first is not None and first.rank in errors else min(errors)
        m = errors[rank]
        at = f" at step {m.group(2)}" if m.group(2) else " while building its stage"
        return f"rank {rank}{at}: {m.group(3)}; {where}"
    failures = {int(m.group(1)): m for text in logs.values() for m in _PIPELINE_FAILURE.finditer(text)}
    if failures:
        rank = min(failures)
        m = failures[rank]
        peer = ""
        if first is not None and first.rank not in failures:
            peer = f"its peer rank {first.rank} {_exit_text(first.code)}"
        elif world == 2:
            peer = f"its peer rank {1 - rank} died or hung"
        cause = peer or f"a peer rank died or hung ({m.group(4)})"
        return (f"rank {rank} stopped at pipeline step {m.group(2)} ({m.group(3)}): {cause}; {where}")
    if first is not None:
        text = logs.get(first.rank, "")
        last = _last_error(text)
        why = f": {last}" if last else ""
        return f"rank {first.rank} {_exit_text(first.code)}{why}; its log is {work / f'rank{first.rank}.log'}"
    last = _last_error(torchrun_log)
    return f"torchrun failed{': ' + last if last else ''}; its log is {work / 'torchrun.log'}"
