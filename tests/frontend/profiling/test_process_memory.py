"""autopipe.frontend.profiling.process_memory: RssAnon counts real copies, not a memory-mapped file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopipe.frontend.profiling.process_memory import rss_anon

pytestmark = pytest.mark.skipif(rss_anon() is None, reason="needs Linux /proc/self/status")

MiB = 2**20


def test_a_copy_counts_and_a_mapped_file_does_not(tmp_path: Path) -> None:
    # A fresh interpreter, so nothing this test process allocated earlier blurs the numbers.
    code = textwrap.dedent("""
        import sys, torch
        from autopipe.frontend.profiling.process_memory import PeakRss
        path = sys.argv[1]
        torch.save({"w": torch.ones(64 * 2**20 // 4)}, path)      # a 64 MiB file
        with PeakRss() as mapped:
            sd = torch.load(path, mmap=True, weights_only=True)
            total = float(sd["w"].sum())                           # every page read
        with PeakRss() as copied:
            w = sd["w"].clone()
        print(mapped.above_start, copied.above_start, total)
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "w.pt")], capture_output=True,
                         text=True, check=True)
    mapped, copied, total = out.stdout.split()
    assert float(total) == 64 * MiB // 4
    assert int(mapped) < 16 * MiB  # reading a mapped file is not anonymous memory
    assert int(copied) >= 60 * MiB  # a copy of it is


def test_the_peak_of_a_short_allocation_is_seen() -> None:
    # A fresh interpreter: in this one an earlier test may have freed heap memory that glibc
    # keeps resident (a profile keeps freed memory in the process), which a new block reuses.
    code = textwrap.dedent("""
        import torch
        from autopipe.frontend.profiling.process_memory import PeakRss
        with PeakRss() as peak:
            block = torch.ones(32 * 2**20 // 4)
            block.add_(1)
            del block
        print(peak.above_start)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 30 * MiB
