"""benchmarks/executor_vs_prediction.py runs tiny over every example and recompute mode, and its
table is consistent (the numbers themselves: the report; no timing thresholds here)."""

from __future__ import annotations

import pytest

from autopipe.frontend.profiling.spawned import comm
from benchmarks import executor_vs_prediction
from tests import forked


@pytest.mark.slow
def test_executor_vs_prediction_runs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    bench = executor_vs_prediction
    rows = bench.main(["--batch", "8", "--chunks", "2", "--repeats", "1", "--rounds", "1"])
    assert [(r.model, r.recompute) for r in rows] == [
        (m, c) for m in ("mlp", "cnn", "gpt", "unet") for c in ("never", "except_last", "always")]
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == "gpipe"
        predicted, measured, ratio = map(float, cells[5:8])
        before, before_ratio = map(float, cells[9:11])
        assert predicted > 0 and measured > 0 and before > 0
        assert ratio == pytest.approx(measured / predicted, abs=2e-3, rel=2e-3)
        low, high = map(float, cells[8].split("-"))
        assert low == high == pytest.approx(ratio, abs=6e-3)  # one round
        assert before_ratio == pytest.approx(measured / before, abs=2e-3, rel=2e-3)
    for r in rows:  # without recomputation the overheads only add a call cost >= 0
        if r.recompute == "never":
            assert r.predicted_ms >= r.before_ms - 1e-9


def test_rounds_pair_each_run_with_its_own_profile() -> None:
    row = executor_vs_prediction.Row("mlp", 8, 2, "never")
    for predicted, measured in ((10.0, 11.0), (20.0, 20.0), (10.0, 30.0)):
        row.add(predicted, measured, loop=measured, before=predicted)
    assert row.ratios == [1.1, 1.0, 3.0]
    assert row.ratio == 1.1  # the median of the rounds' ratios, not of medians
    assert (row.predicted_ms, row.measured_ms) == (10.0, 20.0)


def test_schedules_other_than_gpipe_need_the_distributed_runtime() -> None:
    with pytest.raises(SystemExit):
        executor_vs_prediction.main(["--models", "mlp", "--schedules", "1f1b"])


@pytest.mark.slow
def test_two_ranks_under_both_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    # the link's and the runtime's measurement, its two ranks forked rather than spawned
    # ([Note: processes forked from a server] in tests/forked.py)
    monkeypatch.setattr(comm, "start_processes", forked.start_processes)
    rows = executor_vs_prediction.main(["--runtime", "distributed", "--models", "mlp", "--batch", "8",
                                        "--chunks", "2", "--checkpoints", "except_last", "--repeats", "1",
                                        "--rounds", "1", "--schedules", "gpipe", "1f1b", "--comm-launches", "1",
                                        "--comm-repeats", "2", "--comm-steps", "2"])
    assert [(r.schedule, r.recompute) for r in rows] == [("gpipe", "except_last"), ("1f1b", "except_last")]
    for r in rows:  # the measured transfer and call cost only add to the prediction before them
        assert r.measured_ms > 0 and r.predicted_ms > r.before_ms > 0
