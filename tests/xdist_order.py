"""The order the suite's test files start in when pytest-xdist runs them in parallel.

[Note: slow files first] ``--dist loadfile`` gives each worker whole files (a file's module
fixtures, such as a shared group of ranks, are then built once), and by default queues the files
by how many tests they hold. The suite's time is not in its many small tests but in a few files
that start ranks, torchrun or a gigabyte checkpoint (20-75 s each): queued by test count, some of
those started in the last minute and the run waited on one worker while the other sat idle. So
the collection is reordered (the same on every worker): the files that hold tests marked
``slow`` first, those whose tests are most often slow first (a file of a few long runs of ranks
before one of many short tests and a few slow ones), then the other files, those with the most
tests first; and the scheduler keeps that order. Which tests are ``slow`` is a judgement kept
beside each test (several seconds of wall time), not a table of durations: a file that slows
down only needs its markers.

Imported only where xdist runs (``tests/conftest.py``'s hook), so the suite runs without it.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling


class CollectionOrder(LoadFileScheduling):
    """``--dist loadfile`` with the files queued in collection order, not by test count."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._ordered = False

    def _assign_work_unit(self, node: Any) -> None:
        # The base class's schedule() queues the files by test count just before it assigns
        # the first; put them back in the order the workers collected them (all workers
        # collect the same list, checked by the base class), once.
        if not self._ordered and self.collection:
            first = {self._split_scope(nodeid): None for nodeid in self.collection}
            units = dict(self.workqueue)
            self.workqueue.clear()
            self.workqueue.update((scope, units[scope]) for scope in first if scope in units)
            self._ordered = True
        super()._assign_work_unit(node)


def slow_files_first(items: list[Any]) -> None:
    """Reorder ``items`` in place ([Note: slow files first]); a file's tests keep their order."""
    slow: dict[Any, int] = {}
    count: dict[Any, int] = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[item.path] / count[item.path], -slow[item.path], -count[item.path]))
