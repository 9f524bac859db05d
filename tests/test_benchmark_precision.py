"""benchmarks/precision.py runs its tiny configuration and its tables are consistent; bf16
activations measured are below fp32's on the same stages (bytes do not depend on the load, so
that is a real assertion; times are the report's, no thresholds here).

The split is ``--method uniform`` (14 layers a stage), not the planner's: the planner splits by
the profiled times, which a loaded host skews, and a split whose first stage ends before the
first attention's projection (or whose last holds only ``ln_f`` and the head) holds no bf16
activations smaller than fp32's, or none at all: a loaded run failed so.

One process only, run in this process (``--in-process``): a fresh spawned process per
precision, and 2 gloo ranks, each pay the interpreter's and the tracer's start (about a minute
together on this machine), far past a unit test's budget; the full benchmark runs them
(docs/benchmarks.md, "Mixed precision").
"""

from __future__ import annotations

import math

import pytest

from benchmarks import precision


@pytest.mark.slow
def test_precision_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    rows, acts = precision.main(["--tiny", "--runtimes", "one", "--in-process", "--method", "uniform"])
    assert [(r.runtime, r.precision) for r in rows] == [("one process", "fp32"), ("one process", "bf16")]
    assert rows[0].cut == rows[1].cut == "blocks.1.ln1"  # both precisions on the same split, 14 + 14
    for r in rows:
        assert len(r.times) == 2 and all(math.isfinite(t) and t > 0 for t in r.times)
        assert math.isfinite(r.predicted_ms) and r.predicted_ms > 0 and r.ratio_ms > 0
        assert r.predicted_peak > 0 and r.peak is None  # no memory measured in this process
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1].startswith("torch ") and " cores" in out[1]
    step_lines = [line for line in out if line.startswith("| one process")]
    assert len(step_lines) == 2
    for line, r in zip(step_lines, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 15 and cells[3] == r.precision
        # the cells print the row's values (rounded: a tiny step's 0.1 ms rounding moves a ratio
        # recomputed from them by more than the printed ratio's own rounding)
        measured, predicted, ratio = float(cells[4]), float(cells[6]), float(cells[7])
        assert measured == pytest.approx(r.measured_ms, abs=0.051)
        assert predicted == pytest.approx(r.predicted_ms, abs=0.051)
        assert ratio == pytest.approx(r.ratio_ms, abs=0.0051)
        assert r.ratio_ms == pytest.approx(r.measured_ms / r.predicted_ms)
    bf16_step = [c.strip() for c in step_lines[1].strip("|").split("|")]
    fp32_row, bf16_row = rows
    # bf16 / fp32 ratios present, each the rows' own (a timed one may round to 0.00 on a loaded host)
    assert bf16_step[11:15] == [f"{bf16_row.measured_ms / fp32_row.measured_ms:.2f}",
                                f"{bf16_row.predicted_ms / fp32_row.predicted_ms:.2f}", "-",
                                f"{bf16_row.predicted_peak / fp32_row.predicted_peak:.2f}"]

    assert [(a.precision, a.stage) for a in acts] == [(p, s) for p in ("fp32", "bf16") for s in (0, 1)]
    fp32, bf16 = acts[:2], acts[2:]
    for a in acts:  # ActivationMeter against the plan: within the 10% of memory_vs_prediction
        assert a.measured > 0 and 0.9 <= a.ratio <= 1.1, a
    for low, full in zip(bf16, fp32, strict=True):
        assert low.measured < full.measured and low.predicted < full.predicted, (low, full)
