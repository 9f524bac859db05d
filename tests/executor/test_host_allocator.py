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


def test_use_host_allocator_refuses_an_unknown_choice_in_one_line() -> None:
    with pytest.raises(ValueError, match="host_allocator='jemalloc' is unknown; use 'system'") as err:
        host_allocator.use_host_allocator("jemalloc")
    assert "\n" not in str(err.value)


def test_profile_and_pipeline_refuse_an_unknown_choice_before_measuring() -> None:
    import torch

    import autopipe

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(4, 4)
    for call in (lambda: autopipe.profile(model, (x,), chunks=2, host_allocator="jemalloc"),
                 lambda: autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2,
                                           host_allocator="jemalloc")):
        with pytest.raises(ValueError, match="^host_allocator='jemalloc' is unknown") as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_library_leaves_the_allocator_alone_unless_asked_and_records_it() -> None:
    """profile() and pipeline() change the process's allocator only with host_allocator="retain";
    the profile records the setting, and a pipeline run under the other one warns in one line."""
    code = """
        import warnings
        import torch
        import autopipe
        from executor.host_allocator import host_allocator_in_use
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(8, 8)
        plain = autopipe.profile(model, (x,), chunks=2, repeats=1, warmup=0, mode="layers")
        pipe = autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, profile=plain)
        print(plain.meta["host_allocator"], host_allocator_in_use())
        retained = autopipe.profile(model, (x,), chunks=2, repeats=1, warmup=0, mode="layers",
                                    host_allocator="retain")
        print(retained.meta["host_allocator"], host_allocator_in_use())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autopipe.pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, profile=plain)
        print([str(w.message) for w in caught if "host_allocator" in str(w.message)])
    """
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), "OMP_NUM_THREADS": "1"}
    lines = _run(code, base).splitlines()
    assert lines[0] == "system system"  # asked for nothing: nothing changed
    assert lines[1] == "retain retain"
    assert "measured with host_allocator='system' but this pipeline runs with 'retain'" in lines[2]
    assert "pass host_allocator='system' or re-profile" in lines[2]
