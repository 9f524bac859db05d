"""[Note: layers in sequence]: layer times scaled to the whole graph's, the runtime's recompute ratio."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

import autopipe
from autopipe.frontend.profiling.corrections.in_sequence import (
    MAX_ROUNDS_PER_REPEAT,
    SCALE_RANGE,
    SEQUENCE_MS_PER_REPEAT,
    SequenceScales,
    measure_sequence,
    scale_rows,
    sequence_budget_s,
)
from autopipe.frontend.profiling.harness.timing import CpuTimer, Timer
from autopipe.frontend.tracing.graph import trace
from tests.frontend.profiling.counted import CLOCK, Cost, CountedChain
from tests.models import Chain

T = TypeVar("T")


class ScriptedTimer(Timer):
    """Reports the next of ``times`` (ms) per call, cycling; :meth:`clock` is their sum (s)."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.calls, self.elapsed_s = times, 0, 0.0

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        ms = self.times[self.calls % len(self.times)]
        self.calls += 1
        self.elapsed_s += ms / 1e3
        return fn(), ms

    def clock(self) -> float:
        return self.elapsed_s


ROWS = [{"layer": "a", "fwd_ms": 1.0, "bwd_ms": 2.0}, {"layer": "b", "fwd_ms": 3.0, "bwd_ms": 2.0}]


def _graph() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    x = torch.randn(4, 8, requires_grad=True)
    return trace(Chain((8, 8, 8)), (x,)).gm, [x]


def test_scales_are_whole_over_sum_less_the_harness_once() -> None:
    gm, args = _graph()
    # every forward 7 ms, every backward 9 ms; the harness costs 1 / 1 ms
    timer = ScriptedTimer([7.0, 9.0])
    s = measure_sequence(gm, args, ROWS, torch.device("cpu"), timer, repeats=3, warmup=1,
                         harness=(1.0, 1.0))
    assert (s.fwd, s.bwd) == (6.0 / 4.0, 8.0 / 4.0)
    # GPipe "always" costs what "never" costs here: no recomputation measured, and the ratio
    # says so (None: the sampled one stays), not the clamp's edge
    assert s.recompute_ratio is None
    scaled = scale_rows(ROWS, s)
    assert [r["fwd_ms"] for r in scaled] == [1.5, 4.5] and [r["bwd_ms"] for r in scaled] == [4.0, 4.0]
    assert ROWS[0]["fwd_ms"] == 1.0  # the caller's rows are not modified
    assert s.meta() == {"sequence_fwd_scale": 1.5, "sequence_bwd_scale": 2.0, "sequence_rounds": 3}


def test_a_small_graph_runs_rounds_past_repeats_until_its_budget() -> None:
    gm, args = _graph()
    counted = ScriptedTimer([1.0])
    s = measure_sequence(gm, args, ROWS, torch.device("cpu"), counted, repeats=2, warmup=1,
                         harness=(0.0, 0.0), budget_s=0.05, clock=counted.clock)
    # forward + backward of 3 runs a round, 1 ms each: the 9th round passes the 50 ms (1 warmup)
    assert s.rounds == 8 and counted.calls == 2 * 3 * (1 + s.rounds)
    # a budget no graph reaches stops at the cap; none at all stops at repeats
    assert measure_sequence(gm, args, ROWS, torch.device("cpu"), ScriptedTimer([1.0]), repeats=1, warmup=0,
                            harness=(0.0, 0.0), budget_s=3600.0).rounds == MAX_ROUNDS_PER_REPEAT
    assert measure_sequence(gm, args, ROWS, torch.device("cpu"), ScriptedTimer([1.0]), repeats=2, warmup=0,
                            harness=(0.0, 0.0)).rounds == 2
    assert sequence_budget_s(10) == pytest.approx(10 * SEQUENCE_MS_PER_REPEAT / 1e3)


def test_noise_is_clamped_and_empty_layers_keep_scale_one() -> None:
    gm, args = _graph()
    big = measure_sequence(gm, args, ROWS, torch.device("cpu"), ScriptedTimer([1000.0, 0.5]),
                           repeats=1, warmup=0, harness=(0.0, 0.0))
    assert (big.fwd, big.bwd) == (SCALE_RANGE[1], SCALE_RANGE[0])
    zero = [{**r, "fwd_ms": 0.0, "bwd_ms": 0.0} for r in ROWS]
    none = measure_sequence(gm, args, zero, torch.device("cpu"), ScriptedTimer([5.0]),
                            repeats=1, warmup=0, harness=(0.0, 0.0))
    assert (none.fwd, none.bwd) == (1.0, 1.0)


def test_a_real_profile_scales_to_the_graph_in_sequence_and_layers_mode_has_none() -> None:
    # declared ms (tests/frontend/profiling/counted.py): forward 2 and 6, 1 more each when another
    # layer ran just before (so in sequence, never alone); backward: a's weight half 1 (the
    # model's input needs no gradient), b's 5 + 2; without autograd the forwards take 1.5, 4
    a, b = Cost(2.0, 1.5, 1.0, 3.0, 1.0), Cost(6.0, 4.0, 1.0, 5.0, 2.0)
    timer = CpuTimer(clock=CLOCK)
    whole = autopipe.profile(CountedChain(a, b), (torch.randn(8, 4),), chunks=2, repeats=3, warmup=1,
                             timer=timer, progress=False)
    seq = whole.corrections.sequence
    assert seq is not None and seq.fwd_scale == pytest.approx((3.0 + 7.0) / (2.0 + 6.0))
    assert seq.bwd_scale == pytest.approx(1.0)  # nothing cold in a backward
    assert list(whole.df["fwd_ms"]) == pytest.approx([3.0, 7.0])  # split as stamped in sequence
    assert list(whole.df["bwd_ms"]) == pytest.approx([1.0, 7.0])
    # GPipe recomputes the graph: its checkpointed forwards (cold too) over the whole forward
    assert whole.corrections.recompute_ratio == pytest.approx((2.5 + 5.0) / (3.0 + 7.0))
    layers = autopipe.profile(CountedChain(a, b), (torch.randn(8, 4),), chunks=2, mode="layers", repeats=3,
                              warmup=1, timer=timer, progress=False)
    assert layers.corrections.sequence is None  # never run whole: nothing scaled
    assert list(layers.df["fwd_ms"]) == pytest.approx([2.0, 6.0])  # warm, as timed alone


def test_a_graph_gpipe_cannot_run_keeps_the_sampled_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, args = _graph()

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("cannot gather these outputs")

    monkeypatch.setattr("autopipe.frontend.profiling.corrections.in_sequence.GPipe", refuse)
    s = measure_sequence(gm, args, ROWS, torch.device("cpu"), ScriptedTimer([3.0]), repeats=1,
                         warmup=0, harness=(0.0, 0.0))
    assert s.recompute_ratio is None and SequenceScales().recompute_ratio is None


def test_shares_measured_in_sequence_split_the_sum() -> None:
    s = SequenceScales(fwd=2.0, bwd=1.0, fwd_shares=(0.25, 0.75), bwd_shares=(0.5, 0.5))
    scaled = scale_rows(ROWS, s)  # alone: fwd 1 + 3, bwd 2 + 2
    assert [r["fwd_ms"] for r in scaled] == [2.0, 6.0] and [r["bwd_ms"] for r in scaled] == [2.0, 2.0]
    # shares for another graph, or none timed: every layer keeps its weight alone
    other = SequenceScales(fwd=2.0, bwd=1.0, fwd_shares=(1.0,), bwd_shares=(0.0, 0.0))
    assert [(r["fwd_ms"], r["bwd_ms"]) for r in scale_rows(ROWS, other)] == [(2.0, 2.0), (6.0, 2.0)]


def _chain_rows() -> tuple[torch.fx.GraphModule, list[torch.Tensor], dict[str, str], list[dict[str, object]]]:
    x = torch.randn(4, 8, requires_grad=True)
    g = trace(Chain((8, 8, 8)), (x,))
    return g.gm, [x], g.node_layer, [{"layer": name, "fwd_ms": 1.0, "bwd_ms": 1.0} for name in g.layers]


def test_the_stamped_graph_takes_turns_and_gives_one_share_per_layer() -> None:
    gm, args, node_layer, rows = _chain_rows()
    s = measure_sequence(gm, args, rows, torch.device("cpu"), ScriptedTimer([3.0]), repeats=2,
                         warmup=1, harness=(0.0, 0.0), node_layer=node_layer)
    assert len(s.fwd_shares) == len(s.bwd_shares) == len(rows)
    assert sum(s.fwd_shares) == pytest.approx(1.0) and sum(s.bwd_shares) == pytest.approx(1.0)
    assert sum(r["fwd_ms"] for r in scale_rows(rows, s)) == pytest.approx(s.fwd * len(rows))


def test_a_graph_the_stamps_cannot_run_keeps_the_shares_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gm, args, node_layer, rows = _chain_rows()

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError("cannot stamp this graph")

    monkeypatch.setattr("autopipe.frontend.profiling.corrections.layer_stamps.LayerStamps.run", refuse)
    s = measure_sequence(gm, args, rows, torch.device("cpu"), ScriptedTimer([3.0]), repeats=1,
                         warmup=0, harness=(0.0, 0.0), node_layer=node_layer)
    assert s.fwd_shares == s.bwd_shares == () and s.fwd == 3.0 / len(rows)
