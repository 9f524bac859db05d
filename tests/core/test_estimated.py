"""[Note: estimated or measured]: a profile is all measured or all estimated from one sheet, and
a plan made from an estimate says so first."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

import autopipe
from autopipe.core.estimated import estimate_text, sheet_memory
from autopipe.core.profile_table import Profile
from autopipe.errors import PlanError, ProfileError

SHEET = {"name": "h100", "device": "NVIDIA H100 SXM5 80GB", "memory_bytes": 80 * 2**30}


def _frame(estimated: list[str] | None) -> pd.DataFrame:
    df = pd.DataFrame({"layer": ["a", "b", "c"], "fwd_ms": [1.0, 2.0, 1.0], "bwd_ms": [2.0, 4.0, 2.0],
                       "param_bytes": [10, 20, 10], "output_bytes": [5, 5, 5], "saved_bytes": [5, 5, 5]})
    if estimated is not None:
        df["estimated"] = estimated
    return df


def _estimated() -> Profile:
    return Profile.from_frame(_frame(["h100"] * 3), meta={"estimated": SHEET, "micro_batch_size": 4})


def test_an_estimate_names_its_sheet_and_a_measured_profile_none() -> None:
    assert estimate_text(_estimated().meta) == "h100 (NVIDIA H100 SXM5 80GB)"
    assert sheet_memory(_estimated().meta) == 80 * 2**30
    measured = Profile.from_frame(_frame(None))
    assert estimate_text(measured.meta) is None and sheet_memory(measured.meta) is None
    assert Profile.from_frame(_frame(["", "", ""])).layers == ["a", "b", "c"]  # an empty column: measured


def test_measured_and_estimated_rows_in_one_profile_are_refused_in_one_line() -> None:
    with pytest.raises(ProfileError) as err:
        Profile.from_frame(_frame(["h100", "", "h100"]), meta={"estimated": SHEET})
    assert "mixes measured rows (layer 'b') and rows estimated from device sheet 'h100' (layer 'a')" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ProfileError, match="mixes rows estimated from device sheets 'a100-80gb' and 'h100'"):
        Profile.from_frame(_frame(["h100", "a100-80gb", "h100"]), meta={"estimated": SHEET})
    with pytest.raises(ProfileError, match="rows were estimated from device sheet 'h100' but its meta says it "
                                           "was measured"):
        Profile.from_frame(_frame(["h100"] * 3))
    with pytest.raises(ProfileError, match="meta says it was estimated from device sheet 'h100' but its rows "
                                           "were measured"):
        Profile.from_frame(_frame(None), meta={"estimated": SHEET})
    with pytest.raises(ProfileError, match=r"meta\['estimated'\] must be the device sheet"):
        Profile.from_frame(_frame(None), meta={"estimated": "h100"})


def test_a_saved_estimate_edited_to_mix_in_measured_rows_does_not_load(tmp_path: Path) -> None:
    path = _estimated().save(tmp_path / "est.csv")
    assert Profile.load(path).meta["estimated"] == SHEET
    df = pd.read_csv(path, keep_default_na=False)
    df.loc[1, "estimated"] = ""  # a measured row pasted in
    df.to_csv(path, index=False)
    with pytest.raises(ProfileError, match="mixes measured rows"):
        Profile.load(path)


def test_a_plan_of_an_estimate_says_so_first_and_keeps_it_in_its_json(tmp_path: Path) -> None:
    plan = autopipe.partition(_estimated(), stages=2, chunks=2)
    lines = plan.explain().splitlines()
    assert lines[0].startswith("ESTIMATED, not measured") and "h100 (NVIDIA H100 SXM5 80GB)" in lines[0]
    assert plan.devices[0].memory == 80 * 2**30  # the sheet's memory is each device's
    assert autopipe.partition(_estimated(), stages=2, chunks=2, memory_limit="1GiB").devices[0].memory == 2**30
    measured = autopipe.partition(Profile.from_frame(_frame(None)), stages=2, chunks=2)
    assert measured.estimated_from is None and not measured.explain().startswith("ESTIMATED")
    plan.save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json").estimated_from == plan.estimated_from
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["estimated_from"]  # a plan saved before estimates loads as measured
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert autopipe.Plan.load(tmp_path / "old.json").estimated_from is None
    data["estimated_from"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match="'estimated_from' must be a device sheet's name or null"):
        autopipe.Plan.load(tmp_path / "bad.json")
