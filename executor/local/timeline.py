"""Per (stage, micro-batch, phase) start/end times of one pipeline iteration.

The executor records forward, recompute, backward and transfer spans into a
:class:`TimelineRecorder` when recording is on (``GPipe(..., record_timeline=True)`` or
``with pipe.record_timeline()``); when it is off no recorder exists and nothing is inserted into the autograd graph. CPU spans
are stamped with ``time.perf_counter``; CUDA spans with CUDA events on the stream doing the
work, resolved (one synchronisation) only when the events are read.

Events are executor.spec.TimelineEvent ([Note: timeline events]), times in ms from the start
of the iteration (the pipeline's forward call), the same value the planner's simulator predicts.

Backward spans are cut by identity autograd functions around each (stage, micro-batch):
one on the stage's outputs (fires when their gradients have arrived: the start) and one on
its inputs (fires when the inputs' gradients are computed: the end). To give a stage whose
inputs need no gradient an end mark, its floating-point inputs are made to require one while
tracing (a little extra backward work, traced runs only). A stage without any floating-point
input (e.g. token ids into an embedding) ends at the next backward start on that stage, or
at the end of the backward pass.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from executor.recompute import get_phony
from executor.spec import TimelineEvent

__all__ = ["TimelineRecorder", "to_chrome_trace", "save_chrome_trace"]

Stamp = float | torch.cuda.Event
Key = tuple[int, int, str]


class TimelineRecorder:
    """Collects the spans of one iteration; thread-safe (workers and autograd threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._base: dict[torch.device, tuple[float, torch.cuda.Event]] = {}
        self._spans: dict[Key, list[Stamp | None]] = {}
        self._devices: dict[Key, torch.device] = {}
        self._streams: dict[Key, Any] = {}
        self._soft: set[Key] = set()  # ends that only bound the span (see module docstring)

    def _stamp(self, device: torch.device, stream: Any = None) -> Stamp:
        """Now: host time on CPU, else an event on ``stream`` (default: the current one)."""
        if device.type != "cuda":
            return time.perf_counter()
        with self._lock:
            if device not in self._base:
                base = torch.cuda.Event(enable_timing=True)
                base.record(torch.cuda.current_stream(device))
                self._base[device] = (time.perf_counter(), base)
        event = torch.cuda.Event(enable_timing=True)
        event.record(
            stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(device)
        )
        return event

    def begin(
        self, stage: int, microbatch: int, phase: str, device: torch.device, stream: Any = None
    ) -> None:
        stamp = self._stamp(device, stream)
        with self._lock:
            self._streams[(stage, microbatch, phase)] = stream
            self._spans[(stage, microbatch, phase)] = [stamp, None]
            self._devices[(stage, microbatch, phase)] = device

    def end(self, stage: int, microbatch: int, phase: str, *, soft: bool = False) -> None:
        """Close a span; a ``soft`` end is clipped to the stage's next start of that phase."""
        key = (stage, microbatch, phase)
        with self._lock:
            if soft:
                self._soft.add(key)
            span = self._spans.get(key)
            device = self._devices.get(key)
            stream = self._streams.get(key)
        if span is None or device is None or span[1] is not None:
            return
        span[1] = self._stamp(device, stream)

    @contextmanager
    def span(
        self, stage: int, microbatch: int, phase: str, device: torch.device, stream: Any = None
    ) -> Iterator[None]:
        """Time the block; on CUDA the events go on ``stream`` (default: the current one)."""
        self.begin(stage, microbatch, phase, device, stream)
        try:
            yield
        finally:
            self.end(stage, microbatch, phase)

    def _ms(self, stamp: Stamp, device: torch.device) -> float:
        if isinstance(stamp, float):
            return (stamp - self._t0) * 1e3
        host, base = self._base[device]
        stamp.synchronize()
        return (host - self._t0) * 1e3 + base.elapsed_time(stamp)

    def events(self) -> list[TimelineEvent]:
        """Every recorded span, sorted by start; open backward spans are closed (see module)."""
        with self._lock:
            spans = {k: list(v) for k, v in self._spans.items()}
            devices = dict(self._devices)
        starts = {k: self._ms(v[0], devices[k]) for k, v in spans.items() if v[0] is not None}
        ends = {k: self._ms(v[1], devices[k]) for k, v in spans.items() if v[1] is not None}
        last = max([*starts.values(), *ends.values()], default=0.0)
        out = []
        for key, start in starts.items():
            stage, mb, phase = key
            end = ends.get(key)
            if end is None or key in self._soft:  # bound by the stage's next start of phase
                later = [
                    s for (j, _, p), s in starts.items() if j == stage and p == phase and s > start
                ]
                end = min([*later, last if end is None else end])
            out.append(TimelineEvent(stage, mb, phase, start, max(end, start), measured=True))
        return sorted(out, key=lambda e: (e.start_ms, e.stage, e.microbatch))

    # --- backward marks --------------------------------------------------------------------

    def mark_backward_end(
        self, stage: int, microbatch: int, device: torch.device, tensors: list[Tensor]
    ) -> tuple[list[Tensor], bool]:
        """Insert the end-of-backward mark on a stage's input tensors; False if impossible."""
        idx = [k for k, t in enumerate(tensors) if t.requires_grad or t.is_floating_point()]
        if not idx or not torch.is_grad_enabled():
            return tensors, False
        phony = get_phony(device, requires_grad=True)

        def close() -> None:
            self.end(stage, microbatch, "backward")

        marked = _Mark.apply(close, phony, *[tensors[k] for k in idx])
        out = list(tensors)
        for k, t in zip(idx, marked[1:], strict=True):
            out[k] = t
        return out, True

    def mark_backward_start(
        self,
        stage: int,
        microbatch: int,
        device: torch.device,
        tensors: list[Tensor],
        has_end: bool,
    ) -> list[Tensor]:
        """Insert the start-of-backward mark on a stage's output tensors."""
        idx = [k for k, t in enumerate(tensors) if t.requires_grad]
        if not idx or not torch.is_grad_enabled():
            return tensors

        def open_() -> None:
            self.begin(stage, microbatch, "backward", device)
            if not has_end:
                engine: Any = torch.autograd.Variable._execution_engine
                engine.queue_callback(lambda: self.end(stage, microbatch, "backward", soft=True))

        marked = _Mark.apply(open_, None, *[tensors[k] for k in idx])
        out = list(tensors)
        for k, t in zip(idx, marked[1:], strict=True):
            out[k] = t
        return out


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback`` once all its gradients are in."""

    @staticmethod
    def forward(
        ctx: Any, callback: Callable[[], None], phony: Tensor | None, *xs: Tensor
    ) -> tuple[Any, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        out = tuple(x.detach() for x in xs)
        ctx.mark_non_differentiable(*[x for x in out if not x.is_floating_point()])
        head = phony.detach() if phony is not None else None
        return (head, *out)

    @staticmethod
    def backward(ctx: Any, _head: Tensor | None, *grads: Tensor | None) -> tuple[Any, ...]:
        ctx.callback()
        return (None, None, *grads)


def to_chrome_trace(events: Sequence[TimelineEvent]) -> dict[str, Any]:
    """Chrome-trace / Perfetto JSON: one complete ("X") event per span, a row per stage."""
    trace = [
        {
            "name": f"{e.phase[0].upper()}{e.microbatch}",
            "cat": e.phase,
            "ph": "X",
            "ts": e.start_ms * 1e3,
            "dur": (e.end_ms - e.start_ms) * 1e3,
            "pid": 0,
            "tid": e.stage,
            "args": asdict(e),
        }
        for e in events
    ]
    names = sorted({e.stage for e in events})
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": j, "args": {"name": f"stage {j}"}}
        for j in names
    ]
    return {"traceEvents": meta + trace, "displayTimeUnit": "ms"}


def save_chrome_trace(events: Sequence[TimelineEvent], path: str | Path) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (open it in chrome://tracing or Perfetto)."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(events)))
    return path
