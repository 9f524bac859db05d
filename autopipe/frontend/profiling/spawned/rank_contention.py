"""How much slower a rank computes while another rank computes beside it on the same host.

    prof = profile(model, inputs, comm=True)     # autopipe profile --comm, on a CPU
    prof.corrections.rank_compute_slowdown       # e.g. 1.03

[Note: ranks sharing a host] The profile times every layer in one process with the machine to
itself. Ranks of a pipeline on one host compute at the same time, on their own cores but over
the same memory bus and caches, so each computes more slowly than the profile timed it, forward
and backward alike, by a few percent on a CPU. That is a property of the model
(how much memory traffic its kernels make) and of the host, not of a layer, so it is measured
once per profile on the whole model: its forward and backward on one micro-batch, timed
alone and then with a forked copy of the process running the same step in a loop, in turns
(``TWIN_ROUNDS`` rounds of ``TWIN_RUNS`` runs each: a machine whose speed drifts moves both),
each of the two on the cores a rank of ``autopipe run`` would take ([Note: ranks pinned to
cores] in executor/ranks/rank_cores.py);
the median over the rounds of (beside / alone) is ``rank_compute_slowdown``, clamped to
``SLOWDOWN_RANGE``; where no round timed anything alone (every step took 0 ms on the timer)
there is no slowdown (None), never the clamp's edge, and the profile keeps none. The effect is
a few percent, so each side takes as many runs (``TWIN_RUNS``) as keep a round's spread below
it (figures: docs/benchmarks.md, "Figures behind the Notes").

It is measured only with ``--comm`` (the profile is for ranks on this host, as the transfer
is) and only on a CPU: GPUs do not share their compute, and a CUDA process must not fork. A
copy made by ``fork`` shares the model's pages until it writes them; its gradients are its
own. The cost model multiplies every layer's forward and backward by the factor
(``LayerCosts.from_profile``), so a ``--comm`` profile predicts ranks, not one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopipe.core.planned_precision import precision_of
from autopipe.frontend.profiling.harness.inputs import micro_batch, to_device
from autopipe.frontend.profiling.harness.layer_timing import fresh, timed_step
from autopipe.frontend.profiling.harness.preserve import preserved
from autopipe.frontend.profiling.harness.timing import CpuTimer, Timer
from autopipe.frontend.profiling.harness.under_autocast import autocast_call
from executor.ranks.rank_cores import local_cores, pin_threads

if TYPE_CHECKING:
    from autopipe.core.profile_table import Profile

__all__ = ["SLOWDOWN_RANGE", "TWIN_BUDGET_S", "TWIN_ROUNDS", "TWIN_RUNS", "pinned_pair", "twin", "twin_ratios",
           "twin_slowdown", "with_rank_contention"]

SLOWDOWN_RANGE = (1.0, 1.5)  # below 1 is noise; above, the host is busy with something else
TWIN_ROUNDS = 5
TWIN_RUNS = 15  # per round and side, at most: fewer where the steps would take over TWIN_BUDGET_S
TWIN_BUDGET_S = 6.0
_WARMUP = 3
_TWIN_LIFETIME_S = 120.0  # a twin never outlives this, whatever happens to its parent


@contextlib.contextmanager
def pinned_pair() -> Iterator[list[int] | None]:
    """This process on local rank 0's cores of two ([Note: ranks pinned to cores] in
    executor/ranks/rank_cores.py) until the block ends; yields rank 1's cores, for its twin (None,
    and nothing pinned, with fewer than 2 cores or no CPU affinity)."""
    before = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    mine, other = local_cores(0, 2, before), local_cores(1, 2, before)
    if mine is None:
        yield None
        return
    pin_threads(mine)
    try:
        yield other
    finally:
        pin_threads(before)


@contextlib.contextmanager
def twin(step: Callable[[], object], cores: list[int] | None = None) -> Iterator[int]:
    """A forked copy of this process running ``step`` in a loop until the block ends, on
    ``cores`` when given (yields its pid; it is reaped, or killed and reaped, on the way out)."""
    stop_r, stop_w = os.pipe()
    ready_r, ready_w = os.pipe()
    with warnings.catch_warnings():  # "multi-threaded, use of fork() may lead to deadlocks": the
        warnings.simplefilter("ignore", DeprecationWarning)  # child only runs step and exits
        pid = os.fork()
    if pid == 0:  # the twin: never returns into the caller's code
        try:
            os.close(stop_w)
            os.close(ready_r)
            deadline = time.monotonic() + _TWIN_LIFETIME_S
            if cores is not None:
                pin_threads(cores)
            step()
            os.write(ready_w, b"r")
            while time.monotonic() < deadline and not select.select([stop_r], [], [], 0)[0]:
                step()
        finally:
            os._exit(0)
    os.close(stop_r)
    os.close(ready_w)
    try:
        os.read(ready_r, 1)  # it has run one step: the caches and pages are its own
        yield pid
    finally:
        os.write(stop_w, b"q")
        for fd in (stop_w, ready_r):
            os.close(fd)
        end = time.monotonic() + 10.0
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > end:  # stuck (a lock held at fork): it holds nothing of ours
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


def twin_ratios(step: Callable[[], float], rounds: int = TWIN_ROUNDS, runs: int = TWIN_RUNS) -> list[float]:
    """Each of ``rounds`` rounds' (median ms of ``runs`` steps with a twin running ``step``
    beside this process) / (the same alone, just before), unclamped; ``step()`` returns its
    own ms. Fewer runs (3 at least) where they would take over ``TWIN_BUDGET_S``; a round that
    timed nothing alone (0 ms) gives no ratio."""
    ratios = []
    with pinned_pair() as other:  # as two ranks of `autopipe run` sit on this host
        warm = [step() for _ in range(_WARMUP)]
        runs = max(3, min(runs, int(TWIN_BUDGET_S * 1e3 / (2 * rounds * max(min(warm), 1e-3)))))
        for _ in range(rounds):
            alone = statistics.median(step() for _ in range(runs))
            with twin(step, other):
                beside = statistics.median(step() for _ in range(runs))
            if alone > 0:
                ratios.append(beside / alone)
    return ratios


def twin_slowdown(step: Callable[[], float], rounds: int = TWIN_ROUNDS, runs: int = TWIN_RUNS) -> float | None:
    """The median of :func:`twin_ratios`, clamped to ``SLOWDOWN_RANGE`` ([Note: ranks sharing a
    host]); None where no round gave a ratio (nothing was timed alone)."""
    ratios = twin_ratios(step, rounds, runs)
    if not ratios:
        return None
    return min(max(statistics.median(ratios), SLOWDOWN_RANGE[0]), SLOWDOWN_RANGE[1])


def with_rank_contention(profile: Profile, model: nn.Module, example_inputs: Any, *, timer: Timer | None = None,
                         **kwargs: Any) -> Profile:
    """``profile`` with ``rank_compute_slowdown`` in its corrections ([Note: ranks sharing a host]),
    measured on one micro-batch of ``example_inputs`` (the profile's chunks) with ``timer``
    (wall time unless given; ``kwargs`` go to :func:`twin_slowdown`); the profile as it is where
    it does not apply (a CUDA profile, a model never run whole, no ``os.fork``) or where
    nothing was timed."""
    meta = dict(profile.meta)
    if (meta.get("device_type") or "cpu") != "cpu" or meta.get("mode") == "layers" or not hasattr(os, "fork"):
        return profile
    inputs, _, _ = micro_batch(example_inputs, int(meta.get("chunks") or 1))
    timer, device = timer or CpuTimer(), torch.device("cpu")
    forward = autocast_call(model, precision_of(meta), device)  # [Note: profiling under a precision]
    with preserved(model, device):
        args = to_device(inputs, device)

        def step() -> float:
            return sum(timed_step(timer, lambda: forward(*fresh(list(args)))))

        slowdown = twin_slowdown(step, **kwargs)
    if slowdown is None:  # nothing timed: no slowdown, as where it does not apply
        return profile
    corrections = dataclasses.replace(profile.corrections, rank_compute_slowdown=round(slowdown, 4))
    return dataclasses.replace(profile, corrections=corrections)
