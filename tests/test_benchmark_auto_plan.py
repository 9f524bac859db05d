"""benchmarks/auto_plan.py runs end to end on tiny profiles (the real numbers: README / report)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _module():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "auto_plan.py"
    spec = importlib.util.spec_from_file_location("auto_plan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["auto_plan"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_auto_plan_benchmark_runs_tiny(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    argv = ["--dag-blocks", "2", "--devices", "3", "--dag-batch", "8", "--dag-chunks", "4",
            "--fractions", "0.8", "--layers", "1", "--hidden", "64", "--intermediate", "128",
            "--heads", "2", "--kv-heads", "1", "--vocab", "100", "--seq", "8", "--batch", "4",
            "--chunks", "2", "--repeats", "1", "--threads", "1",
            "--llama-profile", str(tmp_path / "llama")]
    table = _module().main(argv)
    lines = table.splitlines()
    assert lines[0].startswith("| profile |") and len(lines) >= 4
    assert any(line.startswith("| Llama 1 x 64") for line in lines)
    assert (tmp_path / "llama.csv").exists()  # profiled once, read back the next time
    again = _module().main(argv).splitlines()
    assert [line.split("|")[1:4] for line in again] == [line.split("|")[1:4] for line in lines]
