"""benchmarks/split_ratio.py runs its tiny configuration: one row per stage of the 4-stage V,
the stages' layers the whole model's, every time measured, the table printing the rows (times
are the report's, no thresholds here: docs/benchmarks.md, "Split backward per stage")."""

from __future__ import annotations

import math

import pytest

from autopipe.examples import get_example
from autopipe.frontend.tracing.graph import trace
from benchmarks import split_ratio


@pytest.mark.slow
def test_split_ratio_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows = split_ratio.main(["--tiny", "--models", "uneven"])
    ex = get_example("mlp", batch_size=8)
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert sum(r.layers for r in rows) == len(trace(ex.model, ex.inputs).layers)
    for r in rows:
        assert r.model == "UnevenMLP" and all(math.isfinite(t) and t > 0 for t in (r.whole_ms, r.split_ms))
        assert r.charged >= 1.0 and r.measured == r.split_ms / r.whole_ms
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "python benchmarks/split_ratio.py --tiny --models uneven"
    lines = [line for line in out if line.startswith("| UnevenMLP")]
    assert len(lines) == 4 and f"| {rows[2].measured:.2f}x | {rows[2].charged:.2f}x |" in lines[2]


def test_unknown_models_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        split_ratio.main(["--models", "uneven,resnet"])
    assert info.value.code == 2
    assert "--models resnet: choose from uneven, even" in capsys.readouterr().err
