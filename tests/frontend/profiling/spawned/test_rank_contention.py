"""[Note: ranks sharing a host]: a rank's compute beside another, measured with a forked twin
against a slowdown the test sets (tests/frontend/profiling/spawned/beside.py)."""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time

import pytest
import torch

import autopipe
from autopipe.core.layer_costs import LayerCosts
from autopipe.core.profile_table import Profile
from autopipe.frontend.profiling.spawned.rank_contention import (
    SLOWDOWN_RANGE,
    pinned_pair,
    twin,
    twin_ratios,
    twin_slowdown,
    with_rank_contention,
)
from autopipe.solvers.synthetic import random_chain
from tests.frontend.profiling.spawned.beside import BesideTimer, watch_twins
from tests.models import Chain

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _spin_ms(ms: float = 2.0) -> float:
    """CPU work of about ``ms`` on an idle core; returns the wall ms it took."""
    start = time.perf_counter()
    end = time.process_time() + ms / 1e3
    while time.process_time() < end:
        pass
    return (time.perf_counter() - start) * 1e3


_TWIN_WAIT_S = 0.05  # a twin that runs at all runs again well within this (it pauses 1 ms a run)


class _Contended:
    """A step that reports ``ms`` alone and ``factor x ms`` when its forked twin ran during it:
    the twin's runs are counted in memory shared across the fork; no time is measured, so the
    slowdown is ``factor`` whatever else the host runs."""

    def __init__(self, ms: float, factor: float) -> None:
        self.ms, self.factor, self.parent = ms, factor, os.getpid()
        self.counter = mmap.mmap(-1, 8)  # MAP_SHARED: one page for this process and its twins

    def twin_runs(self) -> int:
        return int(struct.unpack_from("q", self.counter)[0])

    def __call__(self) -> float:
        if os.getpid() != self.parent:  # the twin: one more run, then a pause
            struct.pack_into("q", self.counter, 0, self.twin_runs() + 1)
            time.sleep(0.001)
            return self.ms
        before, give_up = self.twin_runs(), time.monotonic() + _TWIN_WAIT_S
        while time.monotonic() < give_up:
            if self.twin_runs() != before:
                return self.ms * self.factor
            time.sleep(0.001)
        return self.ms


@needs_fork
def test_a_twin_beside_slows_the_step_by_what_it_costs_and_is_gone_after() -> None:
    step = _Contended(4.0, factor=1.3)
    assert twin_ratios(step, rounds=3, runs=3) == [pytest.approx(1.3)] * 3
    assert twin_slowdown(step, rounds=1, runs=3) == pytest.approx(1.3)  # inside the clamp: as measured
    runs = step.twin_runs()
    assert runs > 0  # the twins ran the step
    time.sleep(0.02)
    assert step.twin_runs() == runs  # every twin stopped and reaped before twin_slowdown returned


def test_a_slowdown_outside_its_range_is_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    beside = watch_twins(monkeypatch, fork=False)
    for factor, clamped in ((3.0, SLOWDOWN_RANGE[1]), (0.5, SLOWDOWN_RANGE[0]), (1.2, 1.2)):
        timer = BesideTimer(beside, 4.0, factor)

        def step(timer: BesideTimer = timer) -> float:
            return timer(lambda: None)[1]

        assert twin_slowdown(step, rounds=3, runs=3) == pytest.approx(clamped)


def test_nothing_timed_gives_no_slowdown_rather_than_the_clamps_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    beside = watch_twins(monkeypatch, fork=False)
    assert twin_ratios(lambda: 0.0, rounds=2, runs=3) == []
    assert twin_slowdown(lambda: 0.0, rounds=2, runs=3) is None
    prof = random_chain(5, 0)  # a CPU profile of a model run whole; any model will do
    untimed = with_rank_contention(prof, Chain(), (torch.randn(16, 8),), timer=BesideTimer(beside, 0.0, 2.0),
                                   rounds=1, runs=3)
    assert beside.entered > 0 and untimed.corrections.rank_compute_slowdown is None


@needs_fork
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity (Linux) and 2 cores")
def test_the_model_and_its_twin_sit_where_two_ranks_would() -> None:
    # [Note: ranks pinned to cores]: this process on local rank 0's cores, the twin on rank 1's
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    half = len(cores) // 2
    with pinned_pair() as other:
        assert os.sched_getaffinity(0) == set(cores[:half])
        assert other == cores[half:2 * half]
        # twin() returns only once the twin has pinned itself and run a step: nothing to wait for
        with twin(_spin_ms, other) as pid:
            assert os.sched_getaffinity(pid) == set(other)
    assert os.sched_getaffinity(0) == before  # given back


@needs_fork
def test_the_twin_is_gone_after_its_block() -> None:
    with twin(_spin_ms) as pid:
        os.kill(pid, 0)  # running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped: no zombie left behind


@needs_fork
def test_work_that_does_not_compete_measures_no_slowdown() -> None:
    # the twin runs (forked, counting its runs) but the step's time does not depend on it: every
    # round's ratio is 1, unclamped (a wall-clock sleep instead was 0.64-1.39x beside two busy
    # processes: a late wake-up by a 4 ms tick is 20% of a 20 ms sleep)
    step = _Contended(4.0, factor=1.0)
    assert twin_ratios(step, rounds=3, runs=3) == [1.0] * 3 and step.twin_runs() > 0


@needs_fork
def test_the_slowdown_rides_in_a_cpu_profile_and_leaves_the_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # the real twin runs the real model beside it; the timer reports 1.25x while it does
    beside = watch_twins(monkeypatch)
    model, x = Chain(), torch.randn(16, 8)
    prof = autopipe.profile(model, (x,), chunks=2, repeats=1, warmup=0, progress=False)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measured = with_rank_contention(prof, model, (x,), timer=BesideTimer(beside, 2.0, 1.25), rounds=1, runs=3)
    assert beside.entered == 1 and measured.corrections.rank_compute_slowdown == 1.25
    assert measured.corrections.stage_calls == prof.corrections.stage_calls  # its own field only
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # a profile for a GPU, or of a model never run whole, is left as it is
    for other in ({"device_type": "cuda"}, {"mode": "layers"}):
        skipped = dataclasses.replace(prof, meta={**prof.meta, **other})
        assert with_rank_contention(skipped, model, (x,)).corrections.rank_compute_slowdown is None


def test_the_cost_model_scales_every_layer_by_it() -> None:
    base = random_chain(5, 0)
    plain = LayerCosts.from_profile(base)
    slower = LayerCosts.from_profile(Profile(base.df, base.edges, {**base.meta, "rank_compute_slowdown": 1.25}))
    assert slower.fwd == pytest.approx(plain.fwd * 1.25) and slower.bwd == pytest.approx(plain.bwd * 1.25)
    # below 1 is noise: never faster than measured alone
    faster = LayerCosts.from_profile(Profile(base.df, base.edges, {**base.meta, "rank_compute_slowdown": 0.5}))
    assert faster.fwd == pytest.approx(plain.fwd)
