"""[Note: calibrated sheets]: the fit recovers efficiencies and a launch floor it was given, and a
device whose ops cost what a sheet says calibrates to a sheet that estimates them the same."""

from __future__ import annotations

import pytest
import torch

from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.estimated import calibrate as calibration
from autopipe.frontend.profiling.estimated.calibrate import calibrate, fit_efficiencies, shapes_for
from autopipe.frontend.profiling.estimated.op_counts import CountingTimer


def test_the_fit_recovers_the_efficiencies_and_the_floor_it_was_given() -> None:
    truth = {"matmul": 0.6, "attention": 0.3, "elementwise": 0.8}
    floor_ms = 0.02
    rooflines = [{"matmul": 5.0, "elementwise": 0.1}, {"matmul": 0.01}, {"attention": 2.0, "elementwise": 0.3},
                 {"elementwise": 1.0}, {"elementwise": 0.001}, {"matmul": 1.0, "attention": 0.5}]
    ops = [3, 1, 2, 1, 1, 4]
    measured = [sum(r / truth[c] for c, r in row.items()) + n * floor_ms for row, n in zip(rooflines, ops, strict=True)]
    fitted, floor = fit_efficiencies(rooflines, ops, measured)
    assert fitted == pytest.approx(truth) and floor == pytest.approx(floor_ms)
    # a class that beat the roofline is charged at it; a class no layer ran is 1
    faster, _ = fit_efficiencies([{"matmul": 2.0}, {"matmul": 1.0}], [1, 1], [1.0, 0.5])
    assert faster == {"matmul": 1.0, "attention": 1.0, "elementwise": 1.0}


def _truth() -> DeviceSheet:
    data = load_sheet("h100").to_json()
    data.update(name="truth", device_type="cpu", peak_flops_fp32=2e9, peak_flops_bf16=4e9, peak_flops_fp16=4e9,
                memory_bandwidth=1e9, efficiency_matmul=0.5, efficiency_attention=0.25,
                efficiency_elementwise=0.8, launch_us=20.0)
    return DeviceSheet.from_json(data, "truth")


def test_a_device_costing_what_a_sheet_says_calibrates_to_a_sheet_estimating_the_same(monkeypatch) -> None:
    """The timer is the truth sheet's count of each call ([Note: counted, not timed]): the
    calibrated sheet's estimate of every calibration layer must be the truth's."""
    monkeypatch.setattr(calibration, "MAX_SIDE", {"cpu": 512})  # the largest runs past BIG_MS: near its peak
    monkeypatch.setattr(calibration, "COPY_BYTES", {"cpu": 8 << 20})
    shapes = [s for s in shapes_for("cpu") if s.label.startswith(("Linear 8x16", "Linear 64x", "sdpa 8x",
                                                                   "add 1024 ", "gelu 65536", "layer_norm 1024 "))]
    assert len(shapes) >= 8
    truth = CountingTimer(_truth())
    sheet = calibrate("cpu", name="mine", repeats=1, shapes=shapes, timer=truth)
    assert sheet.name == "mine" and sheet.device_type == "cpu" and sheet.memory_bytes > 0
    mine = CountingTimer(sheet)
    for shape in shapes:
        step = shape.make(torch.device("cpu"))
        assert mine(step)[1] == pytest.approx(truth(step)[1], rel=0.01), shape.label
    assert set(sheet.sources) >= {"launch_us", "efficiency_matmul", "peak_flops_fp32", "inter_host_bandwidth"}


def test_calibrate_refuses_what_it_cannot_measure() -> None:
    with pytest.raises(ProfileError, match="repeats must be an int >= 1"):
        calibrate("cpu", repeats=0)
    for device in ("meta", "tpu:0"):
        with pytest.raises(ProfileError, match=f"calibrate measures a cpu or a cuda device, not '{device}'"):
            calibrate(device)
