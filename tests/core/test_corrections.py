"""Corrections: their JSON form, profiles of earlier releases, one profile predicting both runtimes."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest

from autopipe.core.corrections import Corrections, InSequence, LossCost, Phases, Transfer
from autopipe.core.layer_costs import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at
from autopipe.core.simulator import simulate
from autopipe.errors import PartitionError, ProfileError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import random_chain

ROOT = Path(__file__).resolve().parents[2]
BOTH = Corrections(
    harness=Phases(0.01, 0.02),
    stage_calls={"gpipe": {"gpipe": Phases(0.05, 0.07)},
                 "distributed": {"gpipe": Phases(0.2, 0.3), "1f1b": Phases(0.5, 0.7)}},
    recompute_call_ms=0.1, recompute_ratio=1.2, sequence=InSequence(1.1, 0.9, 40),
    loss=LossCost(0.25, 0.5, 4, 4096, 12296), transfer=Transfer(0.07, math.inf, 0.9), rank_compute_slowdown=1.25)
COMM_META = {"stage_call_fwd_ms": 0.2, "stage_call_bwd_ms": 0.3, "stage_call_of": "DistributedPipeline",
             "gpipe_call_fwd_ms": 0.05, "gpipe_call_bwd_ms": 0.07, "stage_call_1f1b_fwd_ms": 0.5,
             "stage_call_1f1b_bwd_ms": 0.7, "comm_latency_ms": 0.07, "comm_bandwidth": 3e9,
             "comm_receive_share": 0.9, "rank_compute_slowdown": 1.25, "comm_backend": "gloo"}


def _chain(corrections: Corrections | None = None) -> Profile:
    base = random_chain(8, 1)
    prof = dataclasses.replace(base, meta={**base.meta, "micro_batch_size": 4, "chunks": 4})
    return prof if corrections is None else dataclasses.replace(prof, corrections=corrections)


def test_corrections_survive_json_and_a_saved_profile(tmp_path: Path) -> None:
    assert Corrections.from_json(json.loads(json.dumps(BOTH.to_json()))) == BOTH
    _chain(BOTH).save(tmp_path / "p")
    again = Profile.load(tmp_path / "p")
    assert again.corrections == BOTH and not any(k.startswith("stage_call") for k in again.meta)


def test_a_loss_saved_before_its_bytes_were_counted_loads_with_none() -> None:
    data = BOTH.to_json()
    loss = data["loss"]
    del loss["held_bytes"], loss["peak_bytes"]
    assert Corrections.from_json(data).loss == LossCost(0.25, 0.5, 4, 0, 0)
    loss["held_bytes"] = -1
    with pytest.raises(ProfileError, match=r"^corrections.loss.held_bytes must be a finite number >= 0"):
        Corrections.from_json(data)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.pop("loss"), r"^corrections lacks key 'loss' \(it needs \["),
    (lambda d: d.update(lost=1), r"^corrections has unknown key 'lost' \(it takes \["),
    (lambda d: d["transfer"].pop("latency_ms"), r"^corrections.transfer lacks key 'latency_ms'"),
    (lambda d: d["stage_calls"]["gpipe"]["gpipe"].update(call_ms=1), r"^corrections.stage_calls.gpipe.gpipe has "
                                                                     r"unknown key 'call_ms'"),
    (lambda d: d["stage_calls"].update(mpi={}), r"^corrections.stage_calls has unknown runtime 'mpi'"),
    (lambda d: d.update(recompute_ratio="x"), r"^corrections.recompute_ratio must be a finite number >= 0"),
])
def test_a_missing_or_unknown_key_is_one_line_naming_it(edit, message) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(json.dumps(BOTH.to_json()))
    edit(data)
    with pytest.raises(ProfileError, match=message) as err:
        Corrections.from_json(data)
    assert "\n" not in str(err.value)


def test_a_saved_profile_with_a_bad_corrections_key_names_file_and_key(tmp_path: Path) -> None:
    path = _chain(BOTH).save(tmp_path / "p").with_suffix(".json")
    side = json.loads(path.read_text())
    del side["corrections"]["rank_compute_slowdown"]
    path.write_text(json.dumps(side))
    with pytest.raises(ProfileError, match=r"p.json: corrections lacks key 'rank_compute_slowdown'"):
        Profile.load(tmp_path / "p")


def test_the_committed_profile_loads_and_predicts_as_its_flat_keys_did() -> None:
    raw = json.loads((ROOT / "profiles" / "mlp.json").read_text())["meta"]
    prof = Profile.load(ROOT / "profiles" / "mlp")
    c = prof.corrections
    assert c.stage_calls == {"gpipe": {"gpipe": Phases(raw["stage_call_fwd_ms"], raw["stage_call_bwd_ms"])}}
    assert c.sequence == InSequence(raw["sequence_fwd_scale"], raw["sequence_bwd_scale"], 0)
    assert (c.loss, c.transfer, c.default_runtime()) == (None, None, "gpipe")
    costs = LayerCosts.from_profile(prof)
    assert (costs.call_fwd_ms, costs.call_bwd_ms) == (raw["stage_call_fwd_ms"], raw["stage_call_bwd_ms"])
    assert (costs.recompute_ratio, costs.recompute_call_ms, costs.comm_latency_ms) == (raw["recompute_ratio"], 0.0, 0.0)
    assert costs.fwd.tolist() == prof.df["fwd_ms"].tolist() and costs.bwd.tolist() == prof.df["bwd_ms"].tolist()


def test_a_comm_profile_of_earlier_releases_keeps_both_runtimes_calls(tmp_path: Path) -> None:
    base = _chain()
    old = Profile(base.df, base.edges, {**base.meta, **COMM_META})
    assert old.meta["comm_backend"] == "gloo" and "stage_call_of" not in old.meta  # descriptive: kept
    assert old.corrections.stage_calls == {"distributed": {"gpipe": Phases(0.2, 0.3), "1f1b": Phases(0.5, 0.7)},
                                           "gpipe": {"gpipe": Phases(0.05, 0.07)}}
    ranks = LayerCosts.from_profile(old)  # as before: the --comm profile predicts the ranks
    assert (ranks.runtime, ranks.call_for("gpipe"), ranks.call_for("interleaved1f1b")) == \
        ("distributed", (0.2, 0.3), (0.5, 0.7))
    assert (ranks.comm_latency_ms, ranks.comm_bandwidth, ranks.comm_receive_share) == (0.07, 3e9, 0.9)
    assert ranks.fwd.tolist() == pytest.approx((base.df["fwd_ms"] * 1.25).tolist())
    one = LayerCosts.from_profile(old, "gpipe")  # and executor.GPipe in one process, its own
    assert (one.call_for("1f1b"), one.comm_latency_ms, one.comm_bandwidth) == ((0.05, 0.07), 0.0, None)
    assert one.fwd.tolist() == base.df["fwd_ms"].tolist()
    old.save(tmp_path / "old")
    assert Profile.load(tmp_path / "old").corrections == old.corrections


def test_one_profile_plans_each_runtime_with_its_own_call_cost() -> None:
    prof = _chain(BOTH)
    assert prof.corrections.default_runtime() == "distributed"
    for runtime, call in (("gpipe", (0.05, 0.07)), ("distributed", (0.5, 0.7))):
        plan = partition(prof, stages=2, chunks=4, recompute="never", schedule="1f1b", runtime=runtime,
                         method="dp")
        assert plan.runtime == runtime
        assert {(st.call_fwd_ms, st.call_bwd_ms) for st in plan.breakdown} == {call}
        assert simulate(plan, prof).iteration_time == pytest.approx(plan.iteration_time)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).runtime == runtime
    assert partition(prof, stages=2, chunks=4, method="dp").runtime == "distributed"
    with pytest.raises(PartitionError, match=r"^runtime='mpi' is unknown; use one of \['gpipe', 'distributed'\]"):
        partition(prof, stages=2, runtime="mpi")


def test_the_distributed_runtime_unmeasured_says_so() -> None:
    prof = _chain(Corrections(stage_calls={"gpipe": {"gpipe": Phases(0.05, 0.07)}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = partition(prof, stages=2, chunks=4, method="dp", runtime="distributed")
    assert [str(w.message).count("\n") for w in caught] == [0]
    assert "measured no call cost of the distributed runtime" in str(caught[0].message)
    assert plan.runtime == "distributed" and plan.breakdown[0].call_fwd_ms == 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert partition(prof, stages=2, chunks=4, method="dp").runtime == "gpipe"  # the default: no warning


def test_an_old_plan_without_a_runtime_loads() -> None:
    data = partition(_chain(), stages=2, chunks=4, method="dp").to_dict()
    del data["runtime"]
    assert Plan.from_dict(data).runtime is None


def test_corrections_and_flat_keys_together_are_refused() -> None:
    base = _chain()
    with pytest.raises(ProfileError, match=r"^meta holds 'loss_fwd_ms' and corrections= was given too"):
        Profile(base.df, base.edges, {**base.meta, "loss_fwd_ms": 1.0}, BOTH)


def test_the_loss_scales_with_the_rows() -> None:
    half = profile_at(_chain(BOTH), 2)
    assert half.corrections.loss == LossCost(0.125, 0.25, 2, 2048, 6148)  # bytes too
    assert half.corrections.stage_calls == BOTH.stage_calls
