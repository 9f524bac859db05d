"""free_port ([Note: a rendezvous port]): below the ephemeral range, free, and the caller's RNG untouched."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from autopipe.frontend.profiling.spawned import ports


def test_the_port_is_below_the_ephemeral_range_and_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "range"
    fake.write_text("40000\t50000\n")
    monkeypatch.setattr(ports, "_RANGE", fake)
    before = random.getstate()
    got = {ports.free_port() for _ in range(20)}
    assert random.getstate() == before  # its own generator
    assert all(30000 <= p < 40000 for p in got)
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: it binds


def test_a_port_taken_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "range"
    fake.write_text("40000 50000")
    monkeypatch.setattr(ports, "_RANGE", fake)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = int(taken.getsockname()[1])
        taken.listen()
        free = next(p for p in range(30000, 40000) if ports._binds(p))
        picks = iter([busy, busy, free])

        class Picks:
            def choice(self, _: range) -> int:
                return next(picks)

        monkeypatch.setattr(ports, "_PICK", Picks())
        assert ports.free_port() == free


@pytest.mark.parametrize("text", [None, "garbage", "1024 2000"])
def test_without_a_range_below_it_the_os_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               text: str | None) -> None:
    fake = tmp_path / "range"
    if text is not None:
        fake.write_text(text)
    monkeypatch.setattr(ports, "_RANGE", fake)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
