"""retain_freed_memory: glibc keeps freed blocks ([Note: freed memory stays in the process])."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from executor import host_allocator


def _run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=env, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_set_once_and_a_users_allocator_choice_is_left_alone() -> None:
    code = """
        from executor.host_allocator import retain_freed_memory
        print(retain_freed_memory(), retain_freed_memory())
    """
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    assert _run(code, base) == "True True"
    assert _run(code, {**base, "MALLOC_TRIM_THRESHOLD_": "0"}) == "False False"
    assert _run(code, {**base, "LD_PRELOAD": "/nonexistent/libjemalloc.so"}).endswith("False False")


def test_without_mallopt_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMallopt:
        def __init__(self, _: object) -> None:
            pass

    monkeypatch.setattr(host_allocator, "_state", {})
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", NoMallopt)
    for name in [k for k in host_allocator.os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert host_allocator.retain_freed_memory() is False
