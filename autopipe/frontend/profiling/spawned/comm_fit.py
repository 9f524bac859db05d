"""The fit of [Note: measured transfer]'s measurements (comm.py) into a profile's metadata.

Each crossing: ``latency + bytes / bandwidth`` (:func:`fit_transfer`); a late receive: the
receiving end's share of it (:func:`receive_share`); each empty pipeline's step: the call cost
per stage and micro-batch whose simulated step takes as long (:func:`fit_call_ms`), on the
empty stages laid out as :func:`empty_stages` says, as the ranks ran them. No torch here: the
simulator is imported only where a call cost is fitted, never in the spawned ranks.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from autopipe.errors import ProfileError
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    stage_rank,
)

__all__ = ["RECEIVE_SHARE_RANGE", "SCHEDULE_CALLS", "empty_stages", "fit_call_ms", "fit_comm", "fit_transfer",
           "receive_share"]

# timed beside GPipe, each on empty stages laid out as its plans are (empty_stages)
SCHEDULE_CALLS = tuple(s for s in SCHEDULES if s != "gpipe")


def empty_stages(schedule: str) -> int:
    """How many empty stages time ``schedule`` on 2 ranks: 4 (two per rank, in a V for the V
    schedules: [Note: stage to rank]) where ranks hold several, else 2."""
    return 4 if schedule in MULTI_STAGE_SCHEDULES else 2


def fit_transfer(nbytes: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
    """``(latency ms, bandwidth bytes/s)`` of ``ms ~ latency + nbytes / bandwidth``, each point
    weighted by ``1 / ms**2`` (relative errors); latency >= 0, bandwidth ``inf`` when the times
    do not grow with the bytes."""
    x, t = np.asarray(nbytes, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    if x.shape != t.shape or x.size < 2 or (t <= 0).any():
        raise ProfileError(f"fit_transfer needs two or more (bytes, ms > 0) points, got {x.tolist()}, {t.tolist()}")
    rows = np.stack([np.ones_like(x), x], axis=1) / t[:, None]  # relative errors: divide by t
    latency, slope = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)[0]
    if slope <= 1e-12:  # no growth with the bytes (over 1e15 bytes/s): a constant
        return float(t.size / np.sum(1.0 / t)), math.inf
    if latency < 0:  # through the origin
        latency, slope = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return float(latency), 1000.0 / float(slope)


def fit_comm(runs: list[list[dict[str, Any]]], backend: str, sizes: Sequence[int], chunks: int) -> dict[str, Any]:
    """The profile metadata from each launch's two ranks' measurements."""
    # a crossing: the slower rank's time, the median launch; each step: its slower launch
    ms = [statistics.median(max(r[0]["ms"][i], r[1]["ms"][i]) for r in runs) for i in range(len(sizes))]
    late = statistics.median(r[0]["late"] for r in runs)
    step = {k: max(rank[k] for r in runs for rank in r) for k in runs[0][0] if k not in ("ms", "late")}
    sent = [max(n // 4, 1) * 4 for n in sizes]  # whole float32s
    latency, bandwidth = fit_transfer(sent, ms)
    ms_per_byte = 0.0 if math.isinf(bandwidth) else 1000.0 / bandwidth
    receive = receive_share(late, max(sent), latency, ms_per_byte)
    call = fit_call_ms(step["gpipe"], "gpipe", chunks, latency, ms_per_byte)
    # the forward-only step: M + 1 forward calls and M crossings in a row
    call_fwd = min(max(step["fwd"] - chunks * (latency + 4 * ms_per_byte), 0.0) / (chunks + 1), call)
    share = call_fwd / call if call > 0 else 0.5
    meta: dict[str, Any] = {
        "comm_backend": backend, "comm_latency_ms": round(latency, 6),
        "comm_bandwidth": None if math.isinf(bandwidth) else round(bandwidth),
        "comm_sizes": sent, "comm_ms": [round(t, 6) for t in ms],
        "comm_late_receive_ms": round(late, 6), "comm_receive_share": round(receive, 4),
        "comm_launches": len(runs),
        "stage_call_fwd_ms": round(call_fwd, 6), "stage_call_bwd_ms": round(call - call_fwd, 6),
        "stage_call_of": "DistributedPipeline"}
    for schedule in SCHEDULE_CALLS:
        if schedule in step:
            fitted = fit_call_ms(step[schedule], schedule, chunks, latency, ms_per_byte, share)
            meta[f"stage_call_{schedule}_fwd_ms"] = round(fitted * share, 6)
            meta[f"stage_call_{schedule}_bwd_ms"] = round(fitted * (1 - share), 6)
    return meta


RECEIVE_SHARE_RANGE = (0.0, 2.0)  # outside it, a measurement is noise: clamp


def receive_share(late_ms: float, nbytes: int, latency_ms: float, ms_per_byte: float) -> float:
    """What a late receive of ``nbytes`` cost beyond the latency, over the bytes' time on the
    wire: the receiving end's share of a crossing ([Note: transfer cost]); 0 where transfers
    are free."""
    if ms_per_byte <= 0 or nbytes <= 0:
        return 0.0
    share = max(late_ms - latency_ms, 0.0) / (nbytes * ms_per_byte)
    return min(max(share, RECEIVE_SHARE_RANGE[0]), RECEIVE_SHARE_RANGE[1])


def fit_call_ms(step_ms: float, schedule: str, chunks: int, latency_ms: float, ms_per_byte: float,
                fwd_share: float = 0.5) -> float:
    """The call cost per stage and micro-batch (forward + backward, split ``fwd_share``) whose
    SIMULATED training step of empty stages on 2 ranks under ``schedule`` (:func:`empty_stages`;
    one float crossing each way per micro-batch and cut; under the zero-bubble schedules each
    backward call split in two, as the simulator splits it) takes ``step_ms``: the simulator's
    own formula, inverted by bisection."""
    from autopipe.core.simulator import simulate_stages  # not in the spawned ranks
    from autopipe.core.stage_cost import StageCost

    def simulated(call: float) -> float:
        stage = StageCost(fwd_ms=0.0, bwd_ms=0.0, recompute_ms=0.0, transfer_ms=0.0, param_bytes=0,
                          activation_bytes=0, input_bytes=4, output_bytes=4, saved_bytes=0,
                          call_fwd_ms=call * fwd_share, call_bwd_ms=call * (1 - fwd_share),
                          latency_ms=latency_ms, bwd_input_ms=0.0 if schedule in ZERO_BUBBLE_SCHEDULES else None)
        k = empty_stages(schedule)
        return simulate_stages([stage] * k, chunks=chunks, recompute="never", ms_per_byte=ms_per_byte,
                               schedule=schedule,
                               devices=[f"rank{stage_rank(schedule, s, 2)}" for s in range(k)]).iteration_time

    low, high = 0.0, max(step_ms, 0.0)
    if simulated(low) >= step_ms:
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(mid) < step_ms else (low, mid)
    return (low + high) / 2
