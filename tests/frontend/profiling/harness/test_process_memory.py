"""autopipe.frontend.profiling.harness.process_memory: RssAnon counts real copies, not a memory-mapped file."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopipe.frontend.profiling.harness.process_memory import rss_anon
from tests import forked

pytestmark = pytest.mark.skipif(rss_anon() is None, reason="needs Linux /proc/self/status")

MiB = 2**20


def _mapped_and_copied(path: str) -> tuple[int | None, int | None, float]:
    import torch

    from autopipe.frontend.profiling.harness.process_memory import PeakRss

    torch.save({"w": torch.ones(64 * 2**20 // 4)}, path)  # a 64 MiB file
    with PeakRss() as mapped:
        sd = torch.load(path, mmap=True, weights_only=True)
        total = float(sd["w"].sum())  # every page read
    with PeakRss() as copied:
        w = sd["w"].clone()
    del w
    return mapped.above_start, copied.above_start, total


def test_a_copy_counts_and_a_mapped_file_does_not(tmp_path: Path) -> None:
    # A process of its own, so nothing this test process allocated earlier blurs the numbers.
    mapped, copied, total = forked.start(_mapped_and_copied, str(tmp_path / "w.pt")).result(timeout=120)
    assert total == 64 * MiB // 4
    assert mapped is not None and mapped < 16 * MiB  # reading a mapped file is not anonymous memory
    assert copied is not None and copied >= 60 * MiB  # a copy of it is


def _short_allocation() -> int | None:
    import torch

    from autopipe.frontend.profiling.harness.process_memory import PeakRss

    with PeakRss() as peak:
        block = torch.ones(32 * 2**20 // 4)
        block.add_(1)
        del block
    return peak.above_start


def test_the_peak_of_a_short_allocation_is_seen() -> None:
    # A process of its own: in this one an earlier test may have freed heap memory that glibc
    # keeps resident (a profile keeps freed memory in the process), which a new block reuses.
    # A fork of the server has freed none ([Note: processes forked from a server]).
    peak = forked.start(_short_allocation).result(timeout=120)
    assert peak is not None and peak >= 30 * MiB
