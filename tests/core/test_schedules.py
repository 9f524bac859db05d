"""The schedule orders (torch's own, checked against torch in tests/test_schedule_parity.py)."""

from __future__ import annotations

import pytest

from autopipe.core.schedules import rank_layout, rank_order, stage_order


def test_gpipe_runs_every_forward_then_every_backward_in_order() -> None:
    assert stage_order("gpipe", 1, 3, 3) == [(1, "F", 0), (1, "F", 1), (1, "F", 2),
                                               (1, "B", 0), (1, "B", 1), (1, "B", 2)]


def test_1f1b_warms_up_k_minus_s_forwards() -> None:
    ops = [(kind, i) for _, kind, i in stage_order("1f1b", 0, 3, 5)]
    assert ops == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4),
                   ("B", 2), ("B", 3), ("B", 4)]
    last = [(kind, i) for _, kind, i in stage_order("1f1b", 2, 3, 3)]
    assert last == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


@pytest.mark.parametrize(("ranks", "local", "chunks"), [(2, 2, 2), (2, 2, 4), (3, 2, 6), (2, 3, 4), (4, 2, 8)])
def test_interleaved_runs_each_operation_once_after_its_forward(ranks: int, local: int, chunks: int) -> None:
    k = ranks * local
    for r in range(ranks):
        ops = rank_order("interleaved1f1b", r, ranks, chunks, local)
        mine = [s for s in range(k) if s % ranks == r]
        assert sorted(ops) == sorted((s, kind, i) for s in mine for kind in "FB" for i in range(chunks))
        for s in mine:
            for i in range(chunks):
                assert ops.index((s, "F", i)) < ops.index((s, "B", i))


def test_interleaved_two_ranks_two_stages_two_microbatches() -> None:
    # warm-up: rank 0 runs both of its stages' forwards first, rank 1 one round less
    assert rank_order("interleaved1f1b", 0, 2, 2, 2) == [
        (0, "F", 0), (0, "F", 1), (2, "F", 0), (2, "F", 1),
        (2, "B", 0), (2, "B", 1), (0, "B", 0), (0, "B", 1)]
    assert rank_order("interleaved1f1b", 1, 2, 2, 2) == [
        (1, "F", 0), (1, "F", 1), (3, "F", 0), (3, "B", 0), (3, "F", 1), (3, "B", 1),
        (1, "B", 0), (1, "B", 1)]


def test_rank_layout() -> None:
    assert rank_layout(["a", "b", "a", "b"]) == (2, [0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"stage s on rank s % ranks.*\['a', 'b', 'a', 'b'\]"):
        rank_layout(["a", "a", "b", "b"])
    with pytest.raises(ValueError, match="unknown"):
        rank_order("zigzag", 0, 2, 2)
