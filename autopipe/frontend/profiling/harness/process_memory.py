"""This process's anonymous resident memory, and its peak over a region, on Linux.

[Note: RssAnon] On CPU, "how much memory did this take" is the process's anonymous resident
memory (``RssAnon`` in /proc/self/status): every real copy of a tensor counts, the pages of a
memory-mapped weights file do not (they are the file's, and the kernel can drop them), which is
what a weights-from-file path must be judged by. ``ru_maxrss`` counts both, so it cannot tell a
copy from a mapping. Linux keeps no high-water mark of RssAnon, so :class:`PeakRss` samples it
from a thread every ``interval`` seconds (1 ms): a peak shorter than that can be missed, which
for the model-sized allocations it is used for (whole stages, whole layers) does not happen.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

__all__ = ["rss_anon", "PeakRss"]

_STATUS = Path("/proc/self/status")


def rss_anon() -> int | None:
    """Bytes of anonymous resident memory of this process now; None where /proc is missing."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


class PeakRss:
    """``with PeakRss() as peak: ...`` then ``peak.bytes``: the highest RssAnon seen inside the
    block (None where it cannot be read), and ``peak.start`` the level on entry."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.start: int | None = None
        self.bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._update()
            self._stop.wait(self.interval)

    def _update(self) -> None:
        now = rss_anon()
        if now is not None and (self.bytes is None or now > self.bytes):
            self.bytes = now

    def __enter__(self) -> PeakRss:
        self.start = rss_anon()
        self.bytes = self.start
        if self.start is not None:
            self._thread = threading.Thread(target=self._sample, name="autopipe-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._update()

    @property
    def above_start(self) -> int | None:
        """Peak minus the level on entry."""
        if self.bytes is None or self.start is None:
            return None
        return self.bytes - self.start
