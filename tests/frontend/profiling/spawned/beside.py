"""A slowdown the test sets: a timer that reports one time alone and another beside a twin.

[Note: ranks sharing a host] measures how much slower a step runs while a forked twin runs it
too. How much slower real work gets depends on the host and on whatever else it runs, so the
tests fix the truth instead: :func:`watch_twins` marks when a twin runs (the real fork, or
none at all), and :class:`BesideTimer` runs every call but reports ``alone_ms`` without a
twin and ``factor x alone_ms`` with one: the measured slowdown must come out as ``factor``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from autopipe.frontend.profiling.harness.timing import Timer
from autopipe.frontend.profiling.spawned import rank_contention

T = TypeVar("T")


class Beside:
    """Whether a twin runs now, as :func:`watch_twins` marks it."""

    def __init__(self) -> None:
        self.twins = 0
        self.entered = 0  # twin blocks entered so far


class BesideTimer(Timer):
    """Runs each call; reports ``alone_ms``, or ``factor x alone_ms`` while a twin runs."""

    def __init__(self, beside: Beside, alone_ms: float, factor: float) -> None:
        self.beside, self.alone_ms, self.factor = beside, alone_ms, factor

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        return fn(), self.alone_ms * (self.factor if self.beside.twins else 1.0)


def watch_twins(monkeypatch: pytest.MonkeyPatch, fork: bool = True) -> Beside:
    """Mark every twin block of rank_contention in the returned :class:`Beside`; with ``fork``
    false, no process is forked at all (the block only marks)."""
    beside, real = Beside(), rank_contention.twin

    @contextlib.contextmanager
    def watched(step: Callable[[], object], cores: list[int] | None = None) -> Iterator[int]:
        with real(step, cores) if fork else contextlib.nullcontext(0) as pid:
            beside.twins += 1
            beside.entered += 1
            try:
                yield pid
            finally:
                beside.twins -= 1

    monkeypatch.setattr(rank_contention, "twin", watched)
    return beside
