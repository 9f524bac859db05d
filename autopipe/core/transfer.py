"""What crossing a cut costs: the one place the cost model prices a transfer.

[Note: transfer cost] A value (a layer's output, ``bytes`` = its largest outgoing edge) lives
from the stage that produces it up to the last stage that consumes it; it crosses every cut in
between, including the cuts of stages it merely passes through. Crossing a cut costs
``latency + bytes / bandwidth`` (``crossing_ms``: one message) forward and again backward (the
gradient). Each transfer is charged to the stage that SENDS it: stage s pays its outgoing cut's
activations and its incoming cut's gradients (``transfer_ms``). Transfers are assumed not to
overlap compute (blocking sends), which is pessimistic on GPUs with copy engines.

The receiving stage pays ``receive_share x bytes / bandwidth`` more for the same message
(``receive_ms``; no latency: that is the wire's). Over gloo's TCP pairs a message moves only
once the receive is posted, and both processes copy it through the kernel: a receive posted
after its send (the activation sent while the receiver computed) still waits for the bytes to
move and copies them in, so on CPU ranks the receiving stage pays about one crossing again,
and a cost model that charged only the sender under-predicted the stages that receive large
activations (CHANGELOG.md, "The receiver pays too"; docs/benchmarks.md, "Figures behind the
Notes").
``autopipe profile --comm`` measures the share (a late receive over a crossing of the same
bytes: ``comm_receive_share``); without it the share is 0 (only the sender pays, as before
measuring).

``bandwidth=None`` or 0 makes transfers free, latency included. Graph inputs cost nothing.
Latency and (unless the caller gives one) bandwidth are measured between two ranks by
``autopipe profile --comm`` (autopipe/frontend/profiling/spawned/comm.py) into the profile's ``comm_latency_ms``
and ``comm_bandwidth``; without them: latency 0, ``DEFAULT_BANDWIDTH``, as before measuring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["DEFAULT_BANDWIDTH", "Amount", "crossing_ms", "receive_ms", "transfer_ms"]

# A number, a numpy array or a PuLP expression: each formula takes any of them.
Amount = Any

DEFAULT_BANDWIDTH = 10e9  # bytes/s between stages when neither the caller nor the profile says


def crossing_ms(nbytes: Amount, ms_per_byte: float, latency_ms: float = 0.0) -> Amount:
    """One cut crossed once by ``nbytes``: latency + bytes / bandwidth; nothing when nothing
    crosses or transfers are free ([Note: transfer cost]). A PuLP sum of bytes is a message
    unless it is empty (the outer cut of a first or last stage)."""
    if not ms_per_byte or not latency_ms:
        return nbytes * ms_per_byte
    sent = nbytes > 0 if isinstance(nbytes, np.ndarray | int | float | np.number) else bool(nbytes)
    return nbytes * ms_per_byte + latency_ms * sent


def receive_ms(nbytes: Amount, ms_per_byte: float, receive_share: float = 0.0) -> Amount:
    """What receiving ``nbytes`` costs the receiving stage on top of the sender's crossing
    ([Note: transfer cost])."""
    if not receive_share or not ms_per_byte:
        return 0.0
    return nbytes * (ms_per_byte * receive_share)


def transfer_ms(input_bytes: Amount, output_bytes: Amount, ms_per_byte: float,
                latency_ms: float = 0.0, receive_share: float = 0.0) -> Amount:
    """What a stage spends on transfers per micro-batch: sending the gradients of its inputs
    and its output activations, receiving its input activations and its outputs' gradients
    ([Note: transfer cost])."""
    return (crossing_ms(input_bytes, ms_per_byte, latency_ms)
            + crossing_ms(output_bytes, ms_per_byte, latency_ms)
            + receive_ms(input_bytes + output_bytes, ms_per_byte, receive_share))
