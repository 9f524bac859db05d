"""executor.ranks.watchdog: one thread fires an overrun arming's action, and only that one."""

from __future__ import annotations

import threading
import time

from executor.ranks.watchdog import armed


def test_an_overrun_fires_and_a_finished_block_does_not() -> None:
    fired: list[str] = []
    done = threading.Event()
    with armed(0.05, lambda: fired.append("quick")):
        pass  # disarmed long before its deadline
    with armed(0.1, lambda: (fired.append("slow"), done.set())):
        with armed(60.0, lambda: fired.append("long")):  # a later deadline does not delay it
            assert done.wait(5.0)
    time.sleep(0.1)
    assert fired == ["slow"]
    assert sum(t.name == "autopipe-watchdog" for t in threading.enumerate()) == 1
