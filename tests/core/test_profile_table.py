from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from autopipe.core.corrections import Corrections
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError


def _frame(n: int = 4) -> pd.DataFrame:
    return pd.DataFrame({
        "layer": [f"l{i}" for i in range(n)],
        "fwd_ms": [1.0 + i for i in range(n)],
        "bwd_ms": [2.0 + i for i in range(n)],
        "param_bytes": [100 * (i + 1) for i in range(n)],
        "output_bytes": [10] * n,
        "saved_bytes": [20] * n,
    })


def test_from_frame_fills_optional_columns_and_chain_edges() -> None:
    prof = Profile.from_frame(_frame(3), meta={"fingerprint": "abc"})
    assert prof.layers == ["l0", "l1", "l2"]
    assert prof.edges == [("l0", "l1", 10), ("l1", "l2", 10)]
    assert list(prof.df["buffer_bytes"]) == [0, 0, 0]
    assert list(prof.df["tie_group"]) == ["", "", ""]
    assert math.isnan(prof.df["peak_bytes"][0])
    assert prof.fingerprint == "abc" and prof.device == "unknown" and len(prof) == 3


def test_save_load_roundtrip(tmp_path: Path) -> None:
    df = _frame(3)
    df["tie_group"] = ["t", "", "t"]
    prof = Profile.from_frame(df, edges=[("l0", "l1", 5), ("l0", "l2", 7)], meta={"device": "cpu"})
    csv = prof.save(tmp_path / "p")
    assert csv == tmp_path / "p.csv" and (tmp_path / "p.json").exists()
    for name in ("p", "p.csv", "p.json"):
        back = Profile.load(tmp_path / name)
        assert back.layers == prof.layers
        assert back.edges == prof.edges
        assert back.meta == {"device": "cpu"}
        assert list(back.df["tie_group"]) == ["t", "", "t"]
        pd.testing.assert_series_equal(back.df["fwd_ms"], prof.df["fwd_ms"])


def test_save_refuses_overwrite_and_keeps_file(tmp_path: Path) -> None:
    Profile.from_frame(_frame(2)).save(tmp_path / "p")
    before = (tmp_path / "p.csv").read_text()
    with pytest.raises(ProfileError, match="already exists.*overwrite=True"):
        Profile.from_frame(_frame(3)).save(tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text() == before
    Profile.from_frame(_frame(3)).save(tmp_path / "p", overwrite=True)
    assert len(Profile.load(tmp_path / "p")) == 3


def test_load_corrupt_json_names_line(tmp_path: Path) -> None:
    Profile.from_frame(_frame(2)).save(tmp_path / "x")
    (tmp_path / "x.json").write_text('{\n "meta": {},\n "edges": [oops]\n}')
    with pytest.raises(ProfileError, match=r"x.json is not valid JSON \(line 3\).*autopipe profile"):
        Profile.load(tmp_path / "x.csv")


def test_load_corrupt_csv(tmp_path: Path) -> None:
    Profile.from_frame(_frame(2)).save(tmp_path / "x")
    (tmp_path / "x.csv").write_text("layer,fwd_ms\nl0,1.0,3,4,5\n")
    with pytest.raises(ProfileError, match="x.csv"):
        Profile.load(tmp_path / "x")
    (tmp_path / "x.csv").write_bytes(b"")
    with pytest.raises(ProfileError, match="not a valid profile CSV"):
        Profile.load(tmp_path / "x")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "nope.csv")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda df: df.drop(columns=["fwd_ms"]), "lacks required column"),
        (lambda df: df.assign(bwd_ms=[1.0, float("nan"), 1.0]), "'bwd_ms' must be numeric"),
        (lambda df: df.assign(fwd_ms=["1", "x", "2"]), "'fwd_ms' must be numeric.*'x'"),
        (lambda df: df.assign(param_bytes=[1, -5, 1]), "non-negative.*'l1'"),
        (lambda df: df.assign(layer=["a", "a", "b"]), "unique"),
        (lambda df: df.iloc[0:0], "no layers"),
    ],
)
def test_validation_errors(mutate, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ProfileError, match=match):
        Profile.from_frame(mutate(_frame(3)))


def test_edge_validation() -> None:
    with pytest.raises(ProfileError, match="unknown layer 'zz'"):
        Profile.from_frame(_frame(3), edges=[("l0", "zz", 1)])
    with pytest.raises(ProfileError, match="backwards"):
        Profile.from_frame(_frame(3), edges=[("l2", "l0", 1)])


def test_check_fingerprint() -> None:
    prof = Profile.from_frame(_frame(2), meta={"fingerprint": "aaa"})
    prof.check_fingerprint("aaa")
    prof.check_fingerprint(None)
    with pytest.raises(ProfileError, match="aaa.*bbb.*re-run autopipe profile"):
        prof.check_fingerprint("bbb")


def test_json_sidecar_is_plain(tmp_path: Path) -> None:
    Profile.from_frame(_frame(2), meta={"repeats": 3}).save(tmp_path / "p")
    side = json.loads((tmp_path / "p.json").read_text())
    assert side == {"meta": {"repeats": 3}, "edges": [["l0", "l1", 10]],
                    "corrections": Corrections().to_json()}

