"""A link between two ranks whose latency, bandwidth and receive share the test sets.

[Note: measured transfer] times a ping-pong and a late receive between two ranks. Over a real
link the truth is whatever gloo and the host make of it. :class:`FakeLink` stands in for both
``torch.distributed`` (``send``, ``recv``, ``barrier``) and ``time`` (``perf_counter``,
``sleep``) in autopipe/frontend/profiling/spawned/comm.py, for two threads that play the two
ranks. Each rank keeps its own virtual clock, which moves only by a sleep, a barrier (both
ranks leave at the later one's time) and a receive: a message of ``n`` bytes sent at ``t``
and received from ``posted`` arrives at ``max(t + L + n / B, posted + L + share x n / B)``:
the bytes cross the wire by themselves, but a receiver that posts late still pays ``share``
of their time (the receiving end's share of a crossing, [Note: transfer cost]). So every time
the measurement reads is exact, and what it fits must be ``L``, ``B`` and ``share``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


class FakeLink:
    """Two ranks' link: ``latency_ms``, ``bytes_per_ms``, ``receive_share`` (see the module)."""

    def __init__(self, latency_ms: float, bytes_per_ms: float, receive_share: float) -> None:
        self.latency_ms, self.bytes_per_ms, self.receive_share = latency_ms, bytes_per_ms, receive_share
        self._wire: dict[tuple[int, int], queue.Queue[tuple[float, int]]] = {
            (0, 1): queue.Queue(), (1, 0): queue.Queue()}
        self._local = threading.local()
        self._meet = threading.Barrier(2, timeout=30)
        self._arrived = [0.0, 0.0]
        self.time = SimpleNamespace(perf_counter=self._now, sleep=self._sleep)  # comm's `time`

    def _now(self) -> float:
        return float(self._local.now)

    def _sleep(self, seconds: float) -> None:
        self._local.now += seconds

    def send(self, x: torch.Tensor, dst: int) -> None:
        self._wire[(1 - dst, dst)].put((self._local.now, x.numel() * x.element_size()))

    def recv(self, x: torch.Tensor, src: int) -> None:
        sent, nbytes = self._wire[(src, 1 - src)].get(timeout=30)
        wire_ms = nbytes / self.bytes_per_ms
        arrives_ms = max(sent * 1e3 + self.latency_ms + wire_ms,
                         self._local.now * 1e3 + self.latency_ms + self.receive_share * wire_ms)
        self._local.now = max(self._local.now, arrives_ms / 1e3)

    def barrier(self) -> None:
        self._arrived[self._local.rank] = self._local.now
        self._meet.wait()
        self._local.now = max(self._arrived)
        self._meet.wait()  # neither writes its next arrival before both have read this one

    def run(self, measure: Callable[[int], Any]) -> list[Any]:
        """``measure(rank)`` on each of two threads, one per rank; their results by rank."""
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            self._local.rank, self._local.now = r, 0.0
            try:
                results[r] = measure(r)
            except BaseException as err:  # noqa: BLE001 - raised again in the caller
                errors.append(err)
                self._meet.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if errors:
            raise errors[0]
        return results
