"""One rank's profile at a TP degree ([Note: tensor-parallel cost]), against hand-computed
values: compute, weights and split activations over t, the all-reduces where Megatron runs them."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from autopipe.core.corrections import Corrections, LossCost
from autopipe.core.profile_table import Profile
from autopipe.core.tensor_parallel import (
    Link,
    at_degree,
    check_degree,
    check_sequence,
    degrees,
    groups,
    structure_text,
    tp_allreduce_ms,
    tp_link,
)
from autopipe.errors import PartitionError

MLP = "mlp:row"
#        layer  role               group    divides fwd  bwd  params out  saved
ROWS = [("emb", "vocab_embedding", "vocab", 64, 1.0, 2.0, 640, 100, 0),
        ("ln", "replicated", "", 0, 2.0, 4.0, 10, 100, 100),
        ("col", "column", MLP, 12, 4.0, 8.0, 800, 200, 100),
        ("act", "sharded", MLP, 12, 2.0, 4.0, 0, 200, 200),
        ("row", "row", MLP, 12, 4.0, 8.0, 800, 100, 200),
        ("add", "replicated", "", 0, 1.0, 2.0, 0, 100, 0),
        ("head", "vocab_head", "vocab", 64, 8.0, 16.0, 640, 640, 100)]
EDGES = [("emb", "ln", 100), ("ln", "col", 100), ("col", "act", 200), ("act", "row", 200),
         ("row", "add", 100), ("emb", "add", 100), ("add", "head", 100)]


def _profile(roles: bool = True, **meta: object) -> Profile:
    cols = ["layer", "tp_role", "tp_group", "tp_divides", "fwd_ms", "bwd_ms", "param_bytes", "output_bytes",
            "saved_bytes"]
    df = pd.DataFrame(ROWS, columns=cols)
    df["tie_group"] = ["tok", "", "", "", "", "", "tok"]
    if not roles:
        df = df.drop(columns=["tp_role", "tp_group", "tp_divides"])
    return Profile.from_frame(df, EDGES, {"micro_batch_size": 4, **meta})


def _col(p: Profile, name: str) -> list[float]:
    return [float(x) for x in p.df[name]]


LINK = Link(ms_per_byte=0.01, latency_ms=0.5)  # all-reduce over 2: 0.01 x bytes + 1 ms


def test_the_all_reduce_is_a_ring_plus_its_latencies() -> None:
    assert tp_allreduce_ms(100, 2, LINK) == pytest.approx(2 * 1 / 2 * 100 * 0.01 + 2 * 1 * 0.5)
    assert tp_allreduce_ms(300, 4, LINK) == pytest.approx(2 * 3 / 4 * 300 * 0.01 + 2 * 3 * 0.5)
    assert tp_allreduce_ms(300, 1, LINK) == 0


def test_one_rank_at_degree_two() -> None:
    p = at_degree(_profile(), 2, LINK)
    comm = 0.01 * 100 + 1  # every all-reduce here moves 100 bytes
    gather = 640 / 2 * 0.01 + 0.5  # the head's 640 bytes of logits, half from the other rank
    # forward: the embedding's and the row's outputs all-reduced, the logits gathered; compute
    # over 2 but ln, add
    assert _col(p, "fwd_ms") == pytest.approx([0.5 + comm, 2.0, 2.0, 1.0, 2.0 + comm, 1.0, 4.0 + gather])
    # backward: the group's input gradient at its column (ln -> col: 100), the head's input's
    assert _col(p, "bwd_ms") == pytest.approx([1.0, 4.0, 4.0 + comm, 2.0, 4.0, 2.0, 8.0 + comm])
    assert _col(p, "param_bytes") == [320, 10, 400, 0, 400, 0, 320]
    assert _col(p, "saved_bytes") == [0, 100, 100, 100, 100, 0, 100]  # the row's and act's inputs
    assert _col(p, "output_bytes") == [100, 100, 100, 100, 100, 100, 640]  # col, act; the logits whole
    assert dict(((u, v), b) for u, v, b in p.edges) == {
        ("emb", "ln"): 100, ("ln", "col"): 100, ("col", "act"): 100, ("act", "row"): 100,
        ("row", "add"): 100, ("emb", "add"): 100, ("add", "head"): 100}
    assert p.meta["tensor_parallel"] == 2 and p.layers == _profile().layers


def _with_sequence_layers() -> Profile:
    df = _profile().df.copy()
    df.loc[df["layer"].isin(["ln", "add"]), "tp_role"] = "sequence"
    return Profile.from_frame(df, EDGES, {"micro_batch_size": 4})


def test_sequence_layers_are_replicated_without_sequence_parallelism() -> None:
    plain, tagged = at_degree(_profile(), 2, LINK), at_degree(_with_sequence_layers(), 2, LINK)
    for col in ("fwd_ms", "bwd_ms", "param_bytes", "saved_bytes", "output_bytes"):
        assert _col(tagged, col) == pytest.approx(_col(plain, col)), col
    assert tagged.edges == plain.edges


def test_sequence_parallelism_splits_the_layers_between_groups_by_tokens() -> None:
    p = at_degree(_with_sequence_layers(), 2, LINK, sequence=True)
    comm = 0.01 * 100 + 1  # a reduce-scatter and an all-gather of 100 bytes: one all-reduce's
    gather = 640 / 2 * 0.01 + 0.5
    # ln and add: compute over 2; the collectives where the all-reduces were, of the whole values
    assert _col(p, "fwd_ms") == pytest.approx([0.5 + comm, 1.0, 2.0, 1.0, 2.0 + comm, 0.5, 4.0 + gather])
    assert _col(p, "bwd_ms") == pytest.approx([1.0, 2.0, 4.0 + comm, 2.0, 4.0, 1.0, 8.0 + comm])
    assert _col(p, "param_bytes") == [320, 10, 400, 0, 400, 0, 320]  # a norm's weights stay whole
    assert _col(p, "saved_bytes") == [0, 50, 100, 100, 100, 0, 100]  # the column keeps its gathered input
    assert _col(p, "output_bytes") == [50, 50, 100, 100, 50, 50, 640]  # emb and row reduce-scattered
    assert dict(((u, v), b) for u, v, b in p.edges) == {
        ("emb", "ln"): 50, ("ln", "col"): 50, ("col", "act"): 100, ("act", "row"): 100,
        ("row", "add"): 50, ("emb", "add"): 50, ("add", "head"): 50}
    assert p.meta["sequence_parallel"] is True


@pytest.mark.parametrize("prof, sequence, degree, match", [
    (_with_sequence_layers, True, 1, "needs? tensor_parallel >= 2|give tensor_parallel >= 2"),
    (_profile, True, 2, "marks no layer 'sequence'.*re-run `autopipe profile"),
    (_with_sequence_layers, "yes", 2, "need True or False"),
])
def test_bad_sequence_parallelism_is_one_line(prof: object, sequence: object, degree: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match) as err:
        check_sequence(prof(), sequence, degree)  # type: ignore[operator]
    assert "\n" not in str(err.value)
    check_sequence(prof(), False, degree)  # type: ignore[operator]


def test_degree_one_is_the_profile_itself() -> None:
    prof = _profile()
    assert at_degree(prof, 1, LINK) is prof


def test_a_vocabulary_the_degree_does_not_divide_stays_replicated() -> None:
    p = at_degree(_profile(), 3, Link(0.0))
    assert _col(p, "fwd_ms") == pytest.approx([1.0, 2.0, 4 / 3, 2 / 3, 4 / 3, 1.0, 8.0])
    assert _col(p, "param_bytes") == [640, 10, 267, 0, 267, 0, 640]


def test_other_micro_batch_sizes_all_reduce_their_own_bytes() -> None:
    prof = _profile(micro_batch_sizes=[2, 4])
    for col in ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes"):
        half = prof.df[col] / 2
        prof.df[f"{col}@2"] = half if col.endswith("_ms") else half.astype("int64")
    p = at_degree(prof, 2, LINK)
    comm = 0.01 * 50 + 1  # 50 bytes at 2 rows
    gather = 320 / 2 * 0.01 + 0.5  # the logits at 2 rows
    assert _col(p, "fwd_ms@2") == pytest.approx([0.25 + comm, 1.0, 1.0, 0.5, 1.0 + comm, 0.5, 2.0 + gather])
    assert _col(p, "bwd_ms@2") == pytest.approx([0.5, 2.0, 2.0 + comm, 1.0, 2.0, 1.0, 4.0 + comm])


def test_the_loss_over_gathered_logits_is_whole() -> None:
    # the runtime all-gathers the head's logits before the loss ([Note: tensor parallelism on ranks])
    prof = _profile()
    prof.corrections = replace(Corrections(), loss=LossCost(2.0, 4.0, 4, 800, 1200))
    assert at_degree(prof, 2, Link(0.0)).corrections.loss == prof.corrections.loss


def test_roles_survive_the_csv_round_trip(tmp_path: object) -> None:
    prof = _profile()
    path = prof.save(f"{tmp_path}/p")
    back = Profile.load(path)
    assert groups(back) == groups(prof) == {"vocab": 64, MLP: 12}
    assert list(back.df["tp_role"]) == [r[1] for r in ROWS]


def test_a_profile_without_roles_plans_degree_one_only() -> None:
    old = _profile(roles=False)
    assert groups(old) is None and "not recorded" in structure_text(old)
    check_degree(old, 1, 4, None)
    with pytest.raises(PartitionError, match="records no tensor-parallel roles.*re-run `autopipe profile"):
        check_degree(old, 2, 4, None)


def test_a_model_without_structure_says_so() -> None:
    df = _profile().df.assign(tp_role="replicated", tp_group="", tp_divides=0)
    flat = Profile.from_frame(df, EDGES, {})
    assert groups(flat) == {} and "none found" in structure_text(flat)
    with pytest.raises(PartitionError, match="no tensor-parallel structure.*use tensor_parallel=1"):
        check_degree(flat, 2, 4, None)
    assert degrees(flat, 8, None) == [1]


@pytest.mark.parametrize("degree, devices, host, match", [
    (5, 10, None, "does not divide the 12 features of group mlp:row"),
    (4, 8, 2, "spans hosts of 2 devices"),
    (4, 6, None, "does not divide the 6 devices"),
    (0, 4, None, "need an integer degree >= 1"),
    ("2", 4, None, "need an integer degree >= 1"),
])
def test_bad_degrees_are_one_line(degree: object, devices: int, host: int | None, match: str) -> None:
    with pytest.raises(PartitionError, match=match) as err:
        check_degree(_profile(), degree, devices, host)
    assert "\n" not in str(err.value)


def test_auto_tries_what_divides_devices_host_and_groups() -> None:
    assert degrees(_profile(), 8, None) == [1, 2, 4]  # 8 divides no 12
    assert degrees(_profile(), 8, 2) == [1, 2]
    assert degrees(_profile(), 6, None) == [1, 2, 3, 6]  # 64 need not divide: the vocab replicates


def test_the_link_is_the_sheets_intra_host_one_when_estimated() -> None:
    measured = _profile()
    assert tp_link(measured, 1e9) == Link(1e-6, 0.0)
    assert tp_link(measured, None) == Link(0.0, 0.0)
    sheet = {"name": "h100", "intra_host_bandwidth": 4.5e11, "memory_bytes": 80 << 30}
    df = measured.df.assign(estimated="h100")
    estimated = Profile.from_frame(df, EDGES, {"estimated": sheet})
    assert tp_link(estimated, 5e10) == Link(1e3 / 4.5e11, 0.0)


def test_a_degree_that_does_not_divide_the_heads_names_them() -> None:
    df = _profile().df.copy()
    df.loc[df["tp_group"] == MLP, "tp_group"] = "attention:row"
    df.loc[df["tp_group"] == "attention:row", "tp_divides"] = 2  # gcd of 4 heads and 2 kv heads
    with pytest.raises(PartitionError, match=r"tensor_parallel=4 does not divide the heads and kv heads of "
                                             r"group attention:row \(their greatest common divisor is 2\); "
                                             r"use one of \[1, 2\]"):
        check_degree(Profile.from_frame(df, EDGES, {}), 4, 8, None)
