from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from executor.local.gpipe import GPipe
from executor.local.timeline import TimelineRecorder, save_chrome_trace, to_chrome_trace
from executor.spec import PHASES, TimelineEvent

CPU = torch.device("cpu")


def _pipe(mode: str, **kwargs: object) -> GPipe:
    stages = [nn.Sequential(nn.Linear(8, 32), nn.ReLU()), nn.Linear(32, 32), nn.Linear(32, 4)]
    return GPipe(stages, ["cpu"] * 3, chunks=4, recompute=mode, **kwargs)  # type: ignore[arg-type]


def _iteration(pipe: GPipe) -> None:
    pipe(torch.randn(8, 8)).pow(2).sum().backward()


@pytest.mark.parametrize("mode", ["except_last", "never"])
def test_one_event_per_stage_microbatch_phase(mode: str) -> None:
    pipe = _pipe(mode, record_timeline=True)
    _iteration(pipe)
    events = pipe.last_timeline
    assert events is not None
    keys = Counter((e.stage, e.microbatch, e.phase) for e in events)
    assert all(n == 1 for n in keys.values())
    recomputed = 3 if mode == "except_last" else 0
    per_phase = Counter(e.phase for e in events)
    assert per_phase == Counter(
        {"forward": 12, "backward": 12, **({"recompute": 3 * recomputed} if recomputed else {})}
    )
    assert all(e.phase in PHASES and 0 <= e.start_ms <= e.end_ms for e in events)


def test_timeline_follows_fill_drain_and_reverse_backward() -> None:
    pipe = _pipe("except_last", record_timeline=True)
    _iteration(pipe)
    ev = {(e.stage, e.microbatch, e.phase): e for e in pipe.last_timeline or []}
    for i in range(4):
        for j in range(1, 3):  # forward flows down the stages, backward flows up
            assert ev[(j - 1, i, "forward")].end_ms <= ev[(j, i, "forward")].start_ms
            assert ev[(j, i, "backward")].end_ms <= ev[(j - 1, i, "backward")].end_ms
        for j in range(3):
            if i > 0:  # one device: the stage runs micro-batches in order, backward in reverse
                assert ev[(j, i - 1, "forward")].end_ms <= ev[(j, i, "forward")].start_ms
                assert ev[(j, i, "backward")].start_ms <= ev[(j, i - 1, "backward")].start_ms
            if i < 3:  # recomputation of a stage precedes its backward
                assert ev[(j, i, "recompute")].end_ms <= ev[(j, i, "backward")].end_ms
    last_forward = max(e.end_ms for e in ev.values() if e.phase == "forward")
    assert all(e.start_ms >= last_forward for e in ev.values() if e.phase == "backward")


def test_context_manager_and_off_by_default() -> None:
    pipe = _pipe("always")
    out = pipe(torch.randn(8, 8))
    assert pipe.last_timeline is None
    assert "Mark" not in type(out.grad_fn).__name__
    with pipe.record_timeline() as events:
        _iteration(pipe)
    assert len([e for e in events if e.phase == "backward"]) == 12
    assert {e.phase for e in events} == {"forward", "recompute", "backward"}


def test_stage_without_float_input_still_closes_backward() -> None:
    stages = [nn.Embedding(10, 8), nn.Linear(8, 2)]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=2, recompute="never", record_timeline=True)
    pipe(torch.randint(0, 10, (4, 3))).sum().backward()
    back = {(e.stage, e.microbatch): e for e in pipe.last_timeline or [] if e.phase == "backward"}
    assert set(back) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert back[(0, 1)].end_ms <= back[(0, 0)].start_ms  # closed at the next start on stage 0
    assert back[(0, 0)].end_ms > back[(0, 0)].start_ms  # closed at the end of backward


def test_chrome_trace_json(tmp_path: Path) -> None:
    pipe = _pipe("except_last", record_timeline=True)
    _iteration(pipe)
    events = pipe.last_timeline or []
    path = save_chrome_trace(events, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert {(s["tid"], s["args"]["microbatch"], s["cat"]) for s in spans} == {
        (e.stage, e.microbatch, e.phase) for e in events
    }
    assert all(s["dur"] >= 0 and isinstance(s["ts"], float) for s in spans)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"]
    assert names == ["stage 0", "stage 1", "stage 2"]


def test_recorder_spans_and_export_of_handmade_events() -> None:
    rec = TimelineRecorder()
    with rec.span(1, 0, "forward", CPU):
        pass
    rec.begin(1, 0, "backward", CPU)  # never closed: closed at the last stamp
    (fwd, bwd) = sorted(rec.events(), key=lambda e: e.phase, reverse=True)
    assert (fwd.stage, fwd.microbatch, fwd.phase) == (1, 0, "forward")
    assert fwd.duration_ms >= 0 and bwd.end_ms >= bwd.start_ms
    doc = to_chrome_trace([TimelineEvent(0, 2, "transfer", 1.0, 1.5)])
    span = doc["traceEvents"][-1]
    assert (span["name"], span["ts"], span["dur"]) == ("T2", 1000.0, 500.0)


def test_marks_are_identities_for_gradients() -> None:
    x = torch.randn(4, 8)
    stages = [nn.Linear(8, 8), nn.Linear(8, 8)]
    plain = GPipe(stages, ["cpu", "cpu"], chunks=2)
    out = plain(x)
    out.sum().backward()
    want = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    plain.zero_grad()
    with plain.record_timeline():
        out2: Tensor = plain(x)
        out2.sum().backward()
    torch.testing.assert_close(out2, out)
    for p, g in zip(plain.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g)
