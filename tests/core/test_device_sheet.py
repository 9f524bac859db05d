"""Device sheets: the shipped ones load with a source for every number, the roofline is what
[Note: roofline] says, and every bad sheet is one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.core.device_sheet import NUMBERS, TEXTS, DeviceSheet, load_sheet, shipped_sheets
from autopipe.errors import ProfileError

SHIPPED = ("a100-40gb", "a100-80gb", "b200", "h100", "h200", "l4", "mi300x")


def _sheet(**changes: object) -> dict[str, object]:
    data = load_sheet("h100").to_json()
    data.update(changes)
    return data


def _write(tmp_path: Path, data: object, name: str = "mine.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


def test_every_shipped_sheet_loads_and_names_a_source_for_every_field() -> None:
    assert tuple(shipped_sheets()) == SHIPPED
    for name in SHIPPED:
        sheet = load_sheet(name)
        assert sheet.name == name
        missing = [key for key in (*TEXTS, *NUMBERS) if not sheet.sources.get(key)]
        assert missing == [], f"{name} lacks a source for {missing}"


def test_the_roofline_is_compute_or_memory_bound_over_the_efficiency_plus_the_launch() -> None:
    sheet = DeviceSheet.from_json(_sheet(peak_flops_bf16=1e12, memory_bandwidth=1e9, efficiency_matmul=0.5,
                                         launch_us=10.0), "test")
    # compute-bound: 2e9 FLOPs at 1e12 FLOP/s = 2 ms, at half the roofline 4 ms, plus 0.01 ms
    assert sheet.op_ms("matmul", "bf16", flops=2e9, nbytes=1e6) == pytest.approx(4.01)
    # memory-bound: 1e7 bytes at 1e9 B/s = 10 ms, at half 20 ms
    assert sheet.op_ms("matmul", "bf16", flops=1e3, nbytes=1e7) == pytest.approx(20.01)
    # an integer op is charged at fp32's peak
    assert sheet.peak_flops("int64") == sheet.peak_flops_fp32


def test_a_saved_sheet_loads_back_equal(tmp_path: Path) -> None:
    sheet = load_sheet("mi300x")
    path = sheet.save(tmp_path / "mi.json")
    assert load_sheet(path) == sheet and load_sheet(str(path)) == sheet
    with pytest.raises(ProfileError, match="already exists"):
        sheet.save(path)


def test_an_unknown_sheet_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ProfileError) as err:
        load_sheet("tpu-v5")
    assert "no device sheet 'tpu-v5'" in str(err.value) and "'h100'" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_sheet_missing_a_field_names_it(tmp_path: Path) -> None:
    data = _sheet()
    del data["memory_bandwidth"]
    with pytest.raises(ProfileError, match="lacks field 'memory_bandwidth'"):
        load_sheet(_write(tmp_path, data))


@pytest.mark.parametrize("value", ["fast", None, True, [1.0]])
def test_a_non_numeric_field_is_named(tmp_path: Path, value: object) -> None:
    with pytest.raises(ProfileError, match="field 'peak_flops_fp32' must be a number"):
        load_sheet(_write(tmp_path, _sheet(peak_flops_fp32=value)))


@pytest.mark.parametrize(("key", "value", "wanted"), [("efficiency_attention", 1.5, r"in \(0, 1\]"),
                                                      ("memory_bytes", 0, "> 0"), ("launch_us", -1, "> 0")])
def test_a_number_out_of_range_is_named(tmp_path: Path, key: str, value: float, wanted: str) -> None:
    with pytest.raises(ProfileError, match=f"field '{key}' must be {wanted}"):
        load_sheet(_write(tmp_path, _sheet(**{key: value})))


def test_corrupt_json_unknown_fields_and_missing_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"is not valid JSON \(line 1\)"):
        load_sheet(_write(tmp_path, '{"name": "x",'))
    with pytest.raises(ProfileError, match="must hold a JSON object"):
        load_sheet(_write(tmp_path, [1, 2]))
    with pytest.raises(ProfileError, match="unknown field 'peak_flops_fp8'"):
        load_sheet(_write(tmp_path, _sheet(peak_flops_fp8=1e15)))
    with pytest.raises(ProfileError, match="'sources' names unknown field 'speed'"):
        load_sheet(_write(tmp_path, _sheet(sources={"speed": "a guess"})))
    with pytest.raises(ProfileError, match=r"field 'device_type' must be one of \['cuda', 'cpu'\]"):
        load_sheet(_write(tmp_path, _sheet(device_type="tpu")))
    with pytest.raises(ProfileError, match="does not exist"):
        load_sheet(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="takes a device sheet's name"):
        load_sheet(3)  # type: ignore[arg-type]
