"""torchrun over autopipe's rank modules: its command line, its run, its ranks' failures in one line.

    code = launch_ranks(ranks_command(config, 2, "autopipe.app.rank_main", work / "torchrun"),
                        work, 2, nodes=1, world=2, env=dict(os.environ), timeout=None)

``autopipe run`` (autopipe/app/launch.py) and ``autopipe comm`` (autopipe/app/comm_job.py)
both start ``python -m torch.distributed.run ... -m MODULE --config JSON``, the ranks placed on
this host or on several ([Note: one command line on every node] in autopipe/app/nodes.py).
Nothing here imports torch: ``autopipe comm`` starts its ranks without loading it.

[Note: one line from K ranks] A failing pipeline makes every rank and torchrun itself print a
traceback (41-168 lines for two ranks). The ranks' stderr and torchrun's own go to files in a
log directory instead (``--redirects 2`` keeps the ranks' stdout, the losses, on the
terminal), and the launcher reads them back: a rank's one-line error (rank_main prints one per
AutopipeError / ExecutorError), the ``PipelineFailure`` of a rank whose peer died or hung, and
torchrun's "root cause" (which rank exited first, with which code or signal) become ONE line
naming the rank, the peer and the step, with the log directory; the status is 2. Under
``restarts`` (``autopipe run --max-restarts N``) each failed attempt that torchrun restarts is
its own such line, printed as it happens ([Note: a restart in the log] in
autopipe/app/restart_watch.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from autopipe.app.config import Launch
from autopipe.app.nodes import rendezvous_args
from autopipe.app.restart_watch import Describe, TorchrunWatch
from autopipe.errors import BuildError

__all__ = ["TIMEOUT_EXIT", "RankFailure", "ranks_command", "launch_ranks", "diagnose", "describe_attempts"]

TIMEOUT_EXIT = 124


class RankFailure(BuildError):
    """A rank of ``autopipe run`` or ``autopipe comm`` failed; the message is the one line that
    says which and why."""


def ranks_command(launch: Launch, nproc: int, module: str, log_dir: str | os.PathLike[str] | None,
                  restarts: int = 0) -> list[str]:
    """``torchrun ... -m module --config JSON`` for ``nproc`` ranks in all, placed by ``launch``;
    torchrun restarts them up to ``restarts`` times after a failure."""
    logs = ["--log-dir", str(log_dir), "--redirects", "2"] if log_dir is not None else []
    again = [f"--max-restarts={restarts}"] if restarts else []
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous_args(launch, nproc), *again, *logs,
            "-m", module, "--config", launch.to_json()]


def launch_ranks(command: list[str], work: Path, local: int, *, nodes: int, world: int, env: dict[str, str],
                 timeout: float | None, restarts: int = 0, temporary: bool = False) -> int:
    """Run torchrun's ``command`` (its logs under ``work/torchrun``) for ``local`` ranks here of
    ``world`` on ``nodes`` nodes, restarted up to ``restarts`` times: 0 when they finished, 124
    after ``timeout`` seconds, else RankFailure with the one line of [Note: one line from K ranks].
    A ``temporary`` ``work`` is removed after a launch that finished with nothing left to read
    there (no restart, every line of the ranks' stderr echoed); else it stays, and is named."""
    ranks_dir = work / "torchrun"
    if restarts:  # a rendezvous store kept across restarts hands the new ranks the dead ones' addresses
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}  # (pytorch/pytorch#135712)
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    watch = TorchrunWatch(proc, work / "torchrun.log", world, restarts,
                          describe_attempts(ranks_dir, world, nodes)).start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        print(f"autopipe: no result after {timeout:.0f}s; stopped torchrun (logs in {work})", file=sys.stderr)
        return TIMEOUT_EXIT
    except BaseException:  # Ctrl-C: do not leave the ranks running
        _stop(proc)
        raise
    finally:
        watch.join()
    logs = _collect(ranks_dir, work, local, nodes)
    if code == 0:
        echoed = _echo_warnings(logs, work)
        if watch.failures:
            print(f"autopipe run: finished after {watch.failures} restart(s); each attempt's logs are in "
                  f"{ranks_dir}", file=sys.stderr)
        elif echoed and temporary:
            shutil.rmtree(work, ignore_errors=True)
        return 0
    raise RankFailure(diagnose(logs, (work / "torchrun.log").read_text(encoding="utf-8", errors="replace"),
                               world, work, nodes=nodes))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log_name(local_rank: int, nodes: int) -> str:
    """One host's ranks are ``rankN.log``; a node's are its local ranks, torchrun numbers them all."""
    return f"rank{local_rank}.log" if nodes == 1 else f"local_rank{local_rank}.log"


def _collect(ranks_dir: Path, work: Path, local: int, nodes: int = 1) -> dict[int, str]:
    """Each local rank's stderr, copied to ``work/rankN.log`` (``local_rankN.log`` on one of
    several nodes; torchrun nests it in run/attempt dirs)."""
    logs: dict[int, str] = {}
    for path in sorted(ranks_dir.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime):
        if path.parent.name.isdigit():
            logs[int(path.parent.name)] = path.read_text(encoding="utf-8", errors="replace")
    for rank in range(local):
        (work / _log_name(rank, nodes)).write_text(logs.get(rank, ""), encoding="utf-8")
    return logs


def describe_attempts(ranks_dir: Path, world: int, nodes: int = 1) -> Describe:
    """A failed attempt's one line from its own logs (torchrun's ``attempt_N`` folders)."""
    def describe(attempt: int, local_rank: int, code: int, hung: list[int]) -> str:
        logs, folder = _attempt_logs(ranks_dir, attempt)
        return diagnose(logs, "", world, folder, nodes=nodes, first=(local_rank, code), hung=hung,
                        rank_log=lambda r: folder / str(r) / "stderr.log")

    return describe


def _attempt_logs(ranks_dir: Path, attempt: int) -> tuple[dict[int, str], Path]:
    """Each local rank's stderr in torchrun's ``attempt`` (0: the first run), and its folder."""
    logs, folder = {}, ranks_dir
    for path in ranks_dir.glob(f"*/attempt_{attempt}/*/stderr.log"):
        if path.parent.name.isdigit():
            logs[int(path.parent.name)] = path.read_text(encoding="utf-8", errors="replace")
            folder = path.parent.parent
    return logs, folder


def _echo_warnings(logs: dict[int, str], work: Path, most: int = 8) -> bool:
    """A successful run's stderr lines (warnings), each once, at most ``most`` of them; whether
    that was all of them."""
    seen: list[str] = []
    for rank in sorted(logs):
        for line in logs[rank].splitlines():
            if line.strip() and line not in seen:
                seen.append(line)
    for line in seen[:most]:
        print(line, file=sys.stderr)
    if len(seen) > most:
        print(f"autopipe run: {len(seen) - most} more line(s) of the ranks' stderr in {work}", file=sys.stderr)
        return False
    return True


@dataclass(frozen=True)
class _Exit:
    rank: int
    code: int
    local: int  # its local rank: its log's number on this node


_RANK_ERROR = re.compile(r"^autopipe (run|comm): error on rank (\d+)(?: at step (\d+))?: (.*)$", re.M)
_PIPELINE_FAILURE = re.compile(
    r"^PipelineFailure: rank (\d+)/\d+(?: \([^)]*\))?: pipeline step (\d+) \(([^,]+),[^)]*\) failed: .*?\((.*)\); "
    r"see that rank's log$", re.M)
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?.*?exitcode\s*:\s*(-?\d+)", re.S)


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


def _short(cause: str) -> str:
    """gloo's cause without its source location and advice: ``Connection closed by peer [addr]``."""
    cause = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", cause)
    return cause.split(". This is typically", 1)[0].strip()


def diagnose(logs: dict[int, str], torchrun_log: str, world: int, work: Path, nodes: int = 1,
             first: tuple[int, int] | None = None, hung: Sequence[int] = (),
             rank_log: Callable[[int], Path] | None = None) -> str:
    """ONE line from the ranks' stderr (``logs``, by local rank) and torchrun's: which rank failed,
    at which step, which peer died or hung when that is known, and where the logs are ([Note: one
    line from K ranks]); of ``nodes`` > 1, this node's ranks and logs. ``first``: the (local
    rank, exit code) that failed first, else torchrun's root cause's; ``hung``: ranks known to
    have hung; ``rank_log``: where a local rank's log is (default ``work/rankN.log``)."""
    where = f"the ranks' logs are in {work}" if nodes == 1 else f"this node's ranks' logs are in {work}"
    log_of = rank_log or (lambda r: work / _log_name(r, nodes))
    root = _ROOT.search(torchrun_log)
    exited = None
    if first is not None:  # a local rank: on one of several nodes, its global number is not known
        exited = _Exit(first[0], first[1], first[0])
    elif root:
        rank = int(root.group(1))
        exited = _Exit(rank, int(root.group(3)), int(root.group(2)) if root.group(2) else rank)
    errors = {int(m.group(2)): m for text in logs.values() for m in _RANK_ERROR.finditer(text)}
    if errors:  # a rank's own one-line error: bad input or a runtime check, the root cause
        rank = exited.rank if exited is not None and exited.rank in errors else min(errors)
        m = errors[rank]
        at = f" at step {m.group(3)}" if m.group(3) else " while building its stage" if m.group(1) == "run" else ""
        return f"rank {rank}{at}: {m.group(4)}; {where}"
    failures = {int(m.group(1)): m for text in logs.values() for m in _PIPELINE_FAILURE.finditer(text)}
    if failures:
        rank = min(failures)
        m = failures[rank]
        peer = ""
        if hung:
            peer = f"its peer rank {hung[0]} hung" if len(hung) == 1 else f"ranks {', '.join(map(str, hung))} hung"
        elif exited is not None and exited.rank not in failures:
            peer = f"its peer rank {exited.rank} {_exit_text(exited.code)}"
        elif world == 2:
            peer = f"its peer rank {1 - rank} died or hung"
        cause = peer or f"a peer rank died or hung ({_short(m.group(4))})"
        return (f"rank {rank} stopped at pipeline step {m.group(2)} ({m.group(3)}): {cause}; {where}")
    if exited is not None:
        text = logs.get(exited.local, "")
        last = _last_error(text)
        why = f": {last}" if last else ""
        return f"rank {exited.rank} {_exit_text(exited.code)}{why}; its log is {log_of(exited.local)}"
    last = _last_error(torchrun_log)
    return f"torchrun failed{': ' + last if last else ''}; its log is {work / 'torchrun.log'}"
