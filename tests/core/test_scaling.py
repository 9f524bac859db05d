"""[Note: micro-batch scaling]: a profile at another micro-batch size."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.core.profile_table import Profile
from autopipe.core.scaling import measured_sizes, profile_at, scaled
from autopipe.errors import ProfileError
from autopipe.solvers.synthetic import chain_profile


def _profile() -> Profile:
    prof = chain_profile([1.0, 2.0, 4.0], param_bytes=[100, 200, 300], output_bytes=[80, 40, 8],
                         saved_bytes=[800, 400, 0])
    prof.meta.update(micro_batch_size=8, batch_size=32, chunks=4, fingerprint="full.struct")
    return prof


def test_one_size_scales_activations_and_compute_in_proportion() -> None:
    prof = _profile()
    prof.df["saved_input_bytes"] = [0, 80, 40]  # of saved_bytes: the same share at any size
    half = profile_at(prof, 4, batch_size=32, chunks=8)
    assert half.df["saved_input_bytes"].tolist() == [0, 40, 0]
    assert half.df["fwd_ms"].tolist() == [0.5, 1.0, 2.0]
    assert half.df["bwd_ms"].tolist() == [1.0, 2.0, 4.0]
    assert half.df["saved_bytes"].tolist() == [400, 200, 0]
    assert half.df["output_bytes"].tolist() == [40, 20, 4]
    assert half.edges == [("l0", "l1", 40), ("l1", "l2", 20)]
    assert half.df["param_bytes"].tolist() == [100, 200, 300]  # weights do not depend on rows
    assert (half.meta["micro_batch_size"], half.meta["batch_size"], half.meta["chunks"]) == (4, 32, 8)
    assert half.fingerprint == "*.struct"  # same structure; this shape was never traced
    same = profile_at(prof, 8)
    assert same.df.equals(prof.df) and same.fingerprint == "full.struct"


def test_measured_sizes_are_interpolated() -> None:
    prof = _profile()
    df = prof.df.assign(**{"fwd_ms@2": [0.5, 1.0, 2.0], "bwd_ms@2": [1.0, 2.0, 4.0],
                           "saved_bytes@2": [200, 100, 0], "output_bytes@2": [20, 10, 2]})
    multi = Profile(df, prof.edges, {**prof.meta, "micro_batch_sizes": [2, 8],
                                     "fingerprints": {"4": "four.struct"}})
    assert measured_sizes(multi) == [2, 8]
    # fwd(2) = 0.5, fwd(8) = 1.0 for l0: a fixed 1/3 ms plus 1/12 ms a row
    at4 = profile_at(multi, 4)
    assert at4.df["fwd_ms"][0] == pytest.approx(0.5 + 0.5 * 2 / 6)
    assert at4.df["saved_bytes"][0] == round(200 + 600 * 2 / 6)
    assert at4.fingerprint == "four.struct"  # recorded by the profiler for that size
    # beyond the largest size: the last segment's line; below the smallest: never under proportional
    assert profile_at(multi, 14).df["fwd_ms"][0] == pytest.approx(1.0 + 0.5 * 6 / 6)
    assert profile_at(multi, 1).df["fwd_ms"][0] == pytest.approx(0.5 - 0.5 / 6)
    assert scaled([2, 8], np.array([[1.0], [10.0]]), 1)[0] == pytest.approx(0.5)  # floor: 1.0 x 1/2


def test_bad_multi_size_profiles_say_what_is_missing() -> None:
    prof = _profile()
    prof.meta["micro_batch_sizes"] = [2, 8]
    with pytest.raises(ProfileError, match=r"lists micro-batch size 2 but has no column 'fwd_ms@2'"):
        measured_sizes(prof)
    prof.meta["micro_batch_sizes"] = [2, 4]
    with pytest.raises(ProfileError, match=r"must list distinct row counts >= 1 including"):
        measured_sizes(prof)
    del prof.meta["micro_batch_sizes"], prof.meta["micro_batch_size"]
    with pytest.raises(ProfileError, match=r"does not record its micro-batch rows"):
        profile_at(prof, 4)
