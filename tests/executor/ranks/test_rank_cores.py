"""[Note: ranks pinned to cores]: each local rank on its own run of the host's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from executor.ranks.rank_cores import local_cores, pin_local_rank

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs CPU affinity (Linux) and 2 cores")


@pytest.mark.parametrize(("rank", "world", "available", "cores"), [
    (0, 2, [0, 1], [0]),
    (1, 2, [0, 1], [1]),
    (1, 2, {7, 4, 6, 5}, [6, 7]),  # the process's own cores (taskset, a container), in order
    (1, 2, [4, 5, 6, 7, 8], [6, 7]),  # equal runs: the odd core stays free
    (2, 3, range(12), [8, 9, 10, 11]),
    (0, 1, [0, 1], None),  # one rank: nothing to keep apart
    (0, 3, [0, 1], None),  # fewer cores than ranks: pinning cannot keep them apart
    (2, 2, [0, 1], None),  # not a rank of this host
])
def test_local_cores_are_equal_disjoint_runs(rank: int, world: int, available: list[int],
                                             cores: list[int] | None) -> None:
    assert local_cores(rank, world, available) == cores


def test_every_core_goes_to_one_rank() -> None:
    available = [3, 1, 2, 0, 5, 4, 7, 6]
    runs = [local_cores(r, 4, available) for r in range(4)]
    assert sorted(c for run in runs for c in run or []) == list(range(8))


@needs_affinity
def test_a_rank_pins_every_thread_it_has_and_starts() -> None:
    # in a child process: pinning this one would leave pytest on half the cores
    script = textwrap.dedent("""
        import os, threading, time
        from executor.ranks.rank_cores import local_cores, pin_local_rank
        mine = local_cores(1, 2, os.sched_getaffinity(0))
        started = threading.Event()
        before = threading.Thread(target=lambda: (started.set(), time.sleep(2)), daemon=True)
        before.start()
        started.wait()
        assert pin_local_rank() == mine, (pin_local_rank(), mine)
        after = threading.Thread(target=lambda: time.sleep(2), daemon=True)
        after.start()
        seen = [os.sched_getaffinity(0), os.sched_getaffinity(before.native_id), os.sched_getaffinity(after.native_id)]
        assert all(s == set(mine) for s in seen), seen
        print("pinned", sorted(mine))
    """)
    env = {**os.environ, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pinned ")


def test_one_rank_alone_is_left_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert pin_local_rank() is None
    if before is not None:
        assert os.sched_getaffinity(0) == before
