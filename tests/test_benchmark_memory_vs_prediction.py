"""Predicted per-stage activation memory within 10% of what the stages really keep (bytes do not
depend on the machine's load, so this is a real assertion, not a report)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _module():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_vs_prediction.py"
    spec = importlib.util.spec_from_file_location("memory_vs_prediction", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_vs_prediction"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_activation_memory_is_predicted_within_10_percent() -> None:
    bench = _module()
    rows = bench.main(["--models", "mlp", "gpt", "unet", "--batch", "32"])
    assert len(rows) == 3 * 3 * 2
    for r in rows:  # except_last too: [Note: which micro-batches recompute]
        assert r.measured > 0 and 0.9 <= r.ratio <= 1.1, r
