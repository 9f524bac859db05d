"""The layers run in sequence: what timing each one alone gets wrong, measured on the whole graph.

[Note: layers in sequence] A layer timed alone, over and over on the same copy of its inputs,
finds its weights and inputs in the CPU's caches (or the GPU's L2) and pays nothing for the
layer before it; in the pipeline the same layer runs after the others, on activations that
were just written and weights that were just evicted. On these examples that moves the sum of
the layers' times by -25% to +60% against the same micro-batch through the whole traced graph
(a CNN's forward is the worst: its convolutions stream activations larger than the cache). And
recomputation in the runtime is not the sampled layers' ratio either: it is executor.GPipe's
checkpoint pair around a whole stage.

So, when the model runs whole (``mode="whole"``), the profiler times the traced graph itself
(``g.gm``: all layers in sequence, on the recorded micro-batch), forward and backward, with the
harness's own cost subtracted once ([Note: harness overhead] in layer_timing.py), and scales
the layers' forwards to sum to the whole forward, and their backwards likewise. The scales
``whole / sum of the layers alone`` are kept in the metadata (``sequence_fwd_scale``,
``sequence_bwd_scale``). How the sum is split between the layers, which the partitioner
balances, is measured in sequence too: a stamped copy of the graph takes turns with the runs
below and gives each layer's share ([Note: layer shares in sequence] in layer_stamps.py); a graph
the stamps cannot run keeps the shares measured alone (one scale for every layer).

It then runs the same graph as ONE stage of executor.GPipe (one micro-batch) with
``recompute="never"`` and ``"always"``: the extra time of the second, less what checkpointing
costs any stage call (``recompute_call_ms``, paid per stage), over the whole forward is
``recompute_ratio`` ([Note: measured overheads] in autopipe/frontend/profiling/corrections/overheads.py), which
replaces the ratio sampled on layers alone. The three runs take turns in every round: this
machine's speed drifts by tens of percent over minutes, and separate batches of repeats
measured the drift, not the recomputation. A small graph's round takes a few milliseconds, and
its ``repeats`` rounds then measured the noise as much as the graph (figures: docs/benchmarks.md,
"Figures behind the Notes"): the rounds go on past ``repeats`` until ``repeats x SEQUENCE_MS_PER_REPEAT`` of them have
passed (at most ``MAX_ROUNDS_PER_REPEAT x repeats`` rounds), which a large graph reaches in
its first ``repeats``. A graph GPipe cannot run as one stage, or whose checkpointed runs took
no longer than its plain ones (nothing recomputed measured), keeps the sampled ratio. Layer by
layer (``mode="layers"``) there is no whole run: scales are 1. Timings are noisy, so each scale
is clamped to ``SCALE_RANGE``.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopipe.frontend.profiling.corrections.layer_stamps import LayerStamps
from autopipe.frontend.profiling.corrections.overheads import RATIO_RANGE
from autopipe.frontend.profiling.harness.layer_timing import fresh, timed_step
from autopipe.frontend.profiling.harness.timing import CpuTimer, Timer, median
from autopipe.frontend.profiling.harness.under_autocast import as_stage, autocast_call
from executor.local.gpipe import GPipe

__all__ = ["MAX_ROUNDS_PER_REPEAT", "SCALE_RANGE", "SEQUENCE_MS_PER_REPEAT", "SequenceScales", "measure_sequence",
           "scale_rows", "sequence_budget_s"]

SCALE_RANGE = (0.5, 2.5)  # outside it, a measurement is noise: clamp
SEQUENCE_MS_PER_REPEAT = 40.0  # the rounds' time budget per requested repeat
MAX_ROUNDS_PER_REPEAT = 20


def sequence_budget_s(repeats: int) -> float:
    """How long the rounds of [Note: layers in sequence] go on at least (seconds)."""
    return repeats * SEQUENCE_MS_PER_REPEAT / 1e3


@dataclass(frozen=True)
class SequenceScales:
    """Whole-graph time / sum of layer times, forward and backward; the runtime's recompute
    ratio (None: keep the sampled one); each layer's share of the whole forward and backward
    measured in sequence (empty: the shares alone)."""

    fwd: float = 1.0
    bwd: float = 1.0
    recompute_ratio: float | None = None
    fwd_shares: tuple[float, ...] = ()
    bwd_shares: tuple[float, ...] = ()
    rounds: int = 0  # timed rounds behind these numbers

    def meta(self) -> dict[str, float]:
        return {"sequence_fwd_scale": round(self.fwd, 4), "sequence_bwd_scale": round(self.bwd, 4),
                "sequence_rounds": self.rounds}


def _clamped(value: float, bounds: tuple[float, float]) -> float:
    return min(bounds[1], max(bounds[0], value))


def _scale(whole_ms: float, layers_ms: float) -> float:
    if layers_ms <= 0 or whole_ms <= 0:
        return 1.0
    return _clamped(whole_ms / layers_ms, SCALE_RANGE)


def _flat(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph called with flat positional arguments (a torch.export graph unflattens its
    (args, kwargs) otherwise, and checks their keywords), in train mode as layers are measured
    (the graph's own flag: [Note: train and eval in one graph] in modes.py)."""
    graph = copy.deepcopy(gm.graph)
    graph.set_codegen(fx.graph.CodeGen())
    flat = fx.GraphModule(gm, graph, "WholeGraph")
    flat.training = True
    return flat


def _pipes(gm: fx.GraphModule, device: torch.device, precision: str) -> tuple[GPipe, GPipe] | None:
    """The graph as ONE stage of executor.GPipe, without and with recomputation; None when
    GPipe cannot run it (outputs it cannot gather, ...): the sampled ratio stays."""
    stage = as_stage(gm, precision, device)  # [Note: profiling under a precision]
    try:
        return (GPipe([stage], [device], chunks=1, recompute="never"),
                GPipe([stage], [device], chunks=1, recompute="always"))
    except (RuntimeError, TypeError, ValueError):
        return None


def _clock(timer: Timer) -> Callable[[], float]:
    """The profile timer's clock where it has one (a CpuTimer's), else wall time (seconds)."""
    return timer.clock if isinstance(timer, CpuTimer) else time.perf_counter


def _stamps(gm: fx.GraphModule, node_layer: Mapping[str, str] | None, rows: Sequence[dict[str, Any]],
            device: torch.device, precision: str, clock: Callable[[], float]) -> LayerStamps | None:
    if node_layer is None:
        return None
    try:
        return LayerStamps(gm, node_layer, [str(r["layer"]) for r in rows], device, precision, clock)
    except Exception:  # noqa: BLE001 - the stamps are a refinement: a graph fx cannot regenerate keeps the shares alone
        return None


def measure_sequence(gm: fx.GraphModule, args: Sequence[Any], rows: Sequence[dict[str, Any]],
                     device: torch.device, timer: Timer, repeats: int, warmup: int,
                     harness: tuple[float, float], recompute_call_ms: float = 0.0,
                     node_layer: Mapping[str, str] | None = None, budget_s: float = 0.0,
                     precision: str = "fp32", clock: Callable[[], float] | None = None) -> SequenceScales:
    """[Note: layers in sequence]: ``rows`` are the layers' profile rows (times alone);
    ``recompute_call_ms``: what checkpointing any stage call adds, netted out of the ratio;
    ``node_layer`` (fx node name -> layer, as LayerGraph's): stamp the layers' shares in sequence;
    ``budget_s``: timed rounds go on past ``repeats`` until that long has passed (at most
    ``MAX_ROUNDS_PER_REPEAT x repeats`` rounds); ``precision``: every forward under its autocast
    ([Note: profiling under a precision] in precision.py); ``clock``: what the budget and the
    stamps read (seconds; the timer's clock where it has one, else wall time).

    The plain graph, the two GPipe runs and the stamped graph take turns in every round, so a
    machine whose speed drifts over the measurement slows them alike (their medians are compared)."""
    gm = _flat(gm)
    clock = clock or _clock(timer)
    stamps = _stamps(gm, node_layer, rows, device, precision, clock)
    pipes = _pipes(gm, device, precision)
    runs: list[Callable[..., Any]] = [autocast_call(gm, precision, device), *(pipes or ())]
    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    start, i = clock(), 0
    while i < warmup + repeats or (clock() - start < budget_s
                                   and i < warmup + MAX_ROUNDS_PER_REPEAT * repeats):
        for k, run in enumerate(runs):
            try:
                step = timed_step(timer, functools.partial(run, *fresh(list(args))))
            except (RuntimeError, TypeError, ValueError):  # GPipe cannot run it after all
                if k == 0:  # the plain graph itself
                    raise
                runs, times = runs[:1], times[:1]
                break
            if i >= warmup:
                times[k].append(step)
        if stamps is not None:
            stamps = _stamped_run(stamps, args, keep=i >= warmup)
        i += 1
    fwd_ms = max(0.0, median([f for f, _ in times[0]]) - harness[0])
    bwd_ms = max(0.0, median([b for _, b in times[0]]) - harness[1])
    ratio = None
    if len(times) == 3 and fwd_ms > 0:
        never, always = (median([f + b for f, b in t]) for t in times[1:])
        extra = always - never - recompute_call_ms
        # no recomputation measured: None says so (the sampled ratio stays), never the clamp's edge
        ratio = _clamped(extra / fwd_ms, RATIO_RANGE) if extra > 0 else None
    fwd_shares, bwd_shares = stamps.shares() if stamps is not None else ([], [])
    return SequenceScales(_scale(fwd_ms, sum(float(r["fwd_ms"]) for r in rows)),
                          _scale(bwd_ms, sum(float(r["bwd_ms"]) for r in rows)), ratio,
                          tuple(fwd_shares), tuple(bwd_shares), rounds=i - warmup)


def _stamped_run(stamps: LayerStamps, args: Sequence[Any], keep: bool) -> LayerStamps | None:
    """One round of the stamped graph (kept after the warmup); None once it cannot run."""
    try:
        stamps.run(*fresh(list(args)), keep=keep)
    except Exception:  # noqa: BLE001 - a refinement: never fail the profile for it (shares alone)
        return None
    return stamps


def _split(alone: list[float], scale: float, shares: tuple[float, ...]) -> list[float]:
    """``alone`` scaled to sum to ``scale x sum(alone)``, split by ``shares`` when there is one
    per layer and they add up (else every layer keeps its weight alone)."""
    if len(shares) != len(alone) or sum(shares) <= 0:
        return [t * scale for t in alone]
    total = scale * sum(alone)
    return [total * s for s in shares]


def scale_rows(rows: list[dict[str, Any]], scales: SequenceScales) -> list[dict[str, Any]]:
    """The rows with the layers' forwards and backwards summing to the sequence's, split as
    measured in sequence ([Note: layer shares in sequence])."""
    fwd = _split([float(r["fwd_ms"]) for r in rows], scales.fwd, scales.fwd_shares)
    bwd = _split([float(r["bwd_ms"]) for r in rows], scales.bwd, scales.bwd_shares)
    return [{**r, "fwd_ms": round(f, 6), "bwd_ms": round(b, 6)} for r, f, b in zip(rows, fwd, bwd, strict=True)]
