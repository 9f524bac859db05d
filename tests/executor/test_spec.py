"""executor/spec.py: the rules the runtime and the planner share, pinned on hand-computed cases."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from executor import spec


def test_the_named_sets_are_the_runtime_s() -> None:
    assert spec.RECOMPUTE_MODES == ("always", "except_last", "never")
    assert spec.DATA_PARALLEL_MODES == ("ddp", "fsdp")
    assert spec.DATA_PARALLEL_PHASES == ("allgather", "allreduce", "reducescatter")
    assert spec.PHASES == ("forward", "backward", "weight", "recompute", "transfer",
                           "allgather", "allreduce", "reducescatter")
    assert spec.ZERO_BUBBLE_SCHEDULES == ("interleaved_zb", "zbv", "dualpipev")
    assert spec.SCHEDULES == ("gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
    assert spec.MULTI_STAGE_SCHEDULES == ("interleaved1f1b", "interleaved_zb", "zbv", "dualpipev")
    assert spec.V_SCHEDULES == ("zbv", "dualpipev")
    assert spec.MERGE_RULES == ("unwaited", "adjacent")
    assert spec.PRECISIONS == ("fp32", "bf16", "fp16")
    assert spec.PRECISION_BYTES == {"fp32": 4, "bf16": 2, "fp16": 2}


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
def test_both_merge_rules_are_weighed_under_a_zero_bubble_schedule(schedule: str) -> None:
    assert spec.merge_rules(schedule) == ("unwaited", "adjacent")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b"])
def test_only_the_default_rule_without_split_backwards(schedule: str) -> None:
    assert spec.merge_rules(schedule) == ("unwaited",)


def test_check_merge_rule() -> None:
    assert spec.check_merge_rule("unwaited") == "unwaited"
    assert spec.check_merge_rule("adjacent") == "adjacent"
    with pytest.raises(ValueError, match=r"^merge_backward='all': choose one of \['unwaited', 'adjacent'\]$"):
        spec.check_merge_rule("all")
    with pytest.raises(ValueError):
        spec.merged_backward([], "zbv", 2, rule="all")


def test_stage_rank_in_a_v_and_round_robin() -> None:
    # V: rank r runs stages r and 2W - 1 - r; the V's bottom (W - 1, W) shares the last rank.
    assert [spec.stage_rank("zbv", s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [spec.stage_rank("dualpipev", s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert [spec.stage_rank("interleaved1f1b", s, 3) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [spec.stage_rank("interleaved_zb", s, 2) for s in range(4)] == [0, 1, 0, 1]
    assert [spec.stage_rank("1f1b", s, 4) for s in range(4)] == [0, 1, 2, 3]


def test_merged_backward_unwaited_merges_only_where_no_rank_waits() -> None:
    # zbv on 2 ranks: stages 0..3 on ranks 0, 1, 1, 0. Stage 0 sends no input gradient and
    # stage 2's goes to stage 1 on its own rank: those merge; stages 1 and 3 send to another rank.
    ops = [(0, "I", 0), (0, "W", 0), (1, "I", 0), (1, "W", 0),
           (2, "I", 0), (2, "W", 0), (3, "I", 0), (3, "W", 0)]
    assert spec.merged_backward(ops, "zbv", 2) == [
        (0, "B", 0), (1, "I", 0), (1, "W", 0), (2, "B", 0), (3, "I", 0), (3, "W", 0)]
    assert spec.merged_backward(ops, "zbv", 2, rule="unwaited") == spec.merged_backward(ops, "zbv", 2)
    assert spec.merged_backward(ops, "zbv", 2, rule="adjacent") == [
        (0, "B", 0), (1, "B", 0), (2, "B", 0), (3, "B", 0)]
    # Round-robin on 2 ranks: stage 2's previous stage is on the other rank; on one rank every
    # stage's previous stage is local.
    assert spec.merged_backward(ops[4:6], "interleaved_zb", 2) == [(2, "I", 0), (2, "W", 0)]
    assert spec.merged_backward(ops[4:6], "interleaved_zb", 1) == [(2, "B", 0)]


def test_merged_backward_merges_only_an_i_followed_at_once_by_its_own_w() -> None:
    adj = "adjacent"
    # another micro-batch's W, another stage's W, a W before its I, an I last, F untouched
    assert spec.merged_backward([(0, "I", 0), (0, "W", 1)], "zbv", 2, adj) == [(0, "I", 0), (0, "W", 1)]
    assert spec.merged_backward([(0, "I", 0), (3, "W", 0)], "zbv", 2, adj) == [(0, "I", 0), (3, "W", 0)]
    assert spec.merged_backward([(0, "W", 0), (0, "I", 0)], "zbv", 2, adj) == [(0, "W", 0), (0, "I", 0)]
    assert spec.merged_backward([(0, "F", 0), (0, "I", 0)], "zbv", 2, adj) == [(0, "F", 0), (0, "I", 0)]
    # an I between two pairs; an unmerged op does not swallow the next one
    ops = [(0, "I", 0), (0, "W", 0), (0, "I", 1), (0, "I", 2), (0, "W", 2), (0, "W", 1)]
    assert spec.merged_backward(ops, "zbv", 2, adj) == [
        (0, "B", 0), (0, "I", 1), (0, "B", 2), (0, "W", 1)]
    assert spec.merged_backward([], "zbv", 2) == []


def test_check_precision() -> None:
    for p in ("fp32", "bf16", "fp16"):
        assert spec.check_precision(p) == p
    with pytest.raises(ValueError, match=r"^precision='fp64' is unknown; use one of fp32, bf16, fp16$"):
        spec.check_precision("fp64")
    for bad in (None, 16, ("fp32",)):
        with pytest.raises(ValueError, match="is unknown"):
            spec.check_precision(bad)


def test_recomputed_microbatches_and_which() -> None:
    assert [spec.recomputed_microbatches(m, 4) for m in spec.RECOMPUTE_MODES] == [4, 3, 0]
    assert [spec.recomputed_microbatches(m, 1) for m in spec.RECOMPUTE_MODES] == [1, 0, 0]
    with pytest.raises(ValueError, match=r"^recompute='sometimes' is not a recompute mode; "
                                         r"use one of always, except_last, never$"):
        spec.recomputed_microbatches("sometimes", 4)
    # the R whose backward comes last: micro-batches M - R .. M - 1
    assert [spec.is_recomputed(m, 4, 1) for m in range(4)] == [False, False, False, True]
    assert [spec.is_recomputed(m, 4, 3) for m in range(4)] == [False, True, True, True]
    assert [spec.is_recomputed(m, 4, 0) for m in range(4)] == [False] * 4
    assert [spec.is_recomputed(m, 4, 4) for m in range(4)] == [True] * 4


def _entry(recompute: object = None, checkpoint: object = None) -> object:
    return spec.renamed_recompute(recompute, checkpoint, "entry")


def test_renamed_recompute() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _entry("never") == "never"  # no checkpoint=: no warning
        assert _entry(None) is None
    with pytest.warns(DeprecationWarning) as caught:
        assert _entry("never", "always") == "always"  # checkpoint= wins
    assert len(caught) == 1
    assert str(caught[0].message) == ("entry(checkpoint='always') is now entry(recompute='always'); "
                                      "checkpoint= will be removed in the next release")
    # stacklevel: the line named is a caller's, never spec.py's own (which frame exactly
    # depends on what wraps the function: mutmut's trampoline adds one)
    assert caught[0].filename != spec.__file__


def test_check_stage_recompute() -> None:
    assert spec.check_stage_recompute("except_last", 3) == ["except_last"] * 3
    assert spec.check_stage_recompute(("never", "always"), 2) == ["never", "always"]
    given = ["always", "never"]
    out = spec.check_stage_recompute(given, 2)
    assert out == given and type(out) is list
    with pytest.raises(ValueError, match=r"^recompute='some' is not a recompute mode"):
        spec.check_stage_recompute("some", 2)
    with pytest.raises(ValueError, match=r"^recompute=3 is neither a mode nor a list of modes; pass one "
                                         r"of always, except_last, never, or a list with one per stage$"):
        spec.check_stage_recompute(3, 2)
    with pytest.raises(ValueError, match="neither a mode nor a list"):
        spec.check_stage_recompute({"always"}, 1)
    with pytest.raises(ValueError, match=r"^recompute lists 1 mode\(s\) for 2 stage\(s\); give one mode "
                                         r"per stage, or one mode for all of them$"):
        spec.check_stage_recompute(["always"], 2)
    with pytest.raises(ValueError, match=r"^recompute\[1\]='sometimes' is not a recompute mode; "
                                         r"use one of always, except_last, never$"):
        spec.check_stage_recompute(["always", "sometimes"], 2)
    with pytest.raises(ValueError, match=r"^recompute\[0\]=None is not"):
        spec.check_stage_recompute([None, "never"], 2)


@pytest.mark.parametrize(("schedule", "stages", "ranks", "chunks"), [
    ("gpipe", 3, 3, 1), ("gpipe", 1, 1, 1), ("1f1b", 2, 2, 2), ("1f1b", 3, 3, 5),
    ("interleaved1f1b", 4, 2, 4), ("interleaved1f1b", 2, 2, 1), ("interleaved1f1b", 6, 3, 6),
    ("interleaved1f1b", 4, 2, 3),  # rounds = 1
    ("interleaved1f1b", 4, 2, 1),  # rounds = max(1, 0)
    ("interleaved1f1b", 4, 4, 8),  # rounds 2
    ("interleaved_zb", 4, 2, 6), ("interleaved_zb", 3, 3, 2),
    ("zbv", 4, 2, 1), ("zbv", 2, 1, 1), ("dualpipev", 4, 2, 4), ("dualpipev", 6, 3, 7),
])
def test_check_schedule_accepts(schedule: str, stages: int, ranks: int, chunks: int) -> None:
    spec.check_schedule(schedule, stages, ranks, chunks)


@pytest.mark.parametrize(("schedule", "stages", "ranks", "chunks", "message"), [
    ("pipedream", 2, 2, 2,
     "schedule='pipedream' is unknown; use one of gpipe, 1f1b, interleaved1f1b, interleaved_zb, zbv, dualpipev"),
    ("zbv", 3, 2, 4, "schedule='zbv' runs exactly 2 stages per rank (rank r: stages r and 2W-1-r): "
                     "2 ranks need 4 stages, not 3; use 1 ranks for 2 stages"),
    ("dualpipev", 2, 2, 4, "schedule='dualpipev' runs exactly 2 stages per rank (rank r: stages r and "
                           "2W-1-r): 2 ranks need 4 stages, not 2; use 1 ranks for 2 stages"),
    ("zbv", 1, 1, 4, "use 1 ranks for 2 stages"),
    ("zbv", 6, 2, 4, "2 ranks need 4 stages, not 6; use 3 ranks for 6 stages"),
    ("dualpipev", 4, 2, 3, "schedule='dualpipev' needs chunks >= stages (4), got chunks=3; "
                           "use chunks=4 or more, or schedule='zbv'"),
    ("gpipe", 3, 2, 4, "schedule='gpipe' runs one stage per rank: 3 stages need 3 ranks, not 2; "
                       "use schedule='interleaved1f1b' for more"),
    ("1f1b", 2, 1, 4, "schedule='1f1b' runs one stage per rank"),
    ("1f1b", 3, 3, 2, "schedule='1f1b' needs chunks >= stages (3), got chunks=2; "
                      "use more micro-batches or schedule='gpipe'"),
    ("interleaved1f1b", 3, 2, 4, "schedule='interleaved1f1b' gives every rank the same number of "
                                 "stages: 3 stages cannot be shared by 2 ranks"),
    ("interleaved_zb", 5, 2, 4, "schedule='interleaved_zb' gives every rank the same number"),
    ("interleaved1f1b", 4, 2, 5, "schedule='interleaved1f1b' needs chunks to be a multiple of its "
                                 "rounds (chunks // ranks = 2), got chunks=5; use chunks=4"),
    ("interleaved_zb", 6, 3, 7, "(chunks // ranks = 2), got chunks=7; use chunks=6"),
])
def test_check_schedule_refuses(schedule: str, stages: int, ranks: int, chunks: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        spec.check_schedule(schedule, stages, ranks, chunks)
    text = str(info.value)
    # a whole message (each case's first) is compared whole, a part of one looked for in it
    whole = message.startswith("schedule=") and len(message) > 60
    assert text == message if whole else message in text, text


def test_check_chunks() -> None:
    spec.check_chunks(1)
    spec.check_chunks(7)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError) as info:
            spec.check_chunks(bad)  # type: ignore[arg-type]
        assert str(info.value) == f"chunks must be an int >= 1, got {bad!r}; pass chunks=1 or more"


def test_microbatch_sizes_cut_as_tensor_split() -> None:
    assert spec.microbatch_sizes(10, 4) == [3, 3, 2, 2]
    assert spec.microbatch_sizes(5, 4) == [2, 1, 1, 1]
    assert spec.microbatch_sizes(8, 4) == [2, 2, 2, 2]
    assert spec.microbatch_sizes(4, 4) == [1, 1, 1, 1]
    assert spec.microbatch_sizes(7, 1) == [7]
    for batch in range(1, 30):
        for chunks in range(1, batch + 1):
            sizes = spec.microbatch_sizes(batch, chunks)
            assert len(sizes) == chunks and sum(sizes) == batch
            assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    with pytest.raises(ValueError, match=r"^chunks=4 > batch size 3: micro-batches would be empty; "
                                         r"use chunks <= 3$"):
        spec.microbatch_sizes(3, 4)
    with pytest.raises(ValueError, match="chunks must be an int"):
        spec.microbatch_sizes(3, 0)


def test_timeline_event() -> None:
    event = spec.TimelineEvent(stage=1, microbatch=2, phase="forward", start_ms=1.5, end_ms=4.0)
    assert event.duration_ms == 2.5 and event.measured is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.stage = 2  # type: ignore[misc]
