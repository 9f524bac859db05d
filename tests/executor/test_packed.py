"""executor/packed.py: one packed row cut at sequence starts, and its outputs joined back."""

from __future__ import annotations

import itertools

import pytest
import torch

from executor.errors import MicroBatchError
from executor.packed import (
    gather_packed,
    packed_rows,
    packed_sizes,
    sequence_starts,
    split_packed,
    unpadded,
)


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("lengths", [[5, 7, 3, 9, 4], [1, 1, 1], [12, 1, 1, 1, 1], [3, 3, 3, 3]])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_cuts_fall_on_sequence_starts_and_cover_the_row(lengths: list[int], chunks: int) -> None:
    starts = list(itertools.accumulate([0, *lengths[:-1]]))
    assert sequence_starts(_positions(lengths)) == starts
    sizes = packed_sizes(_positions(lengths), chunks)
    cuts = list(itertools.accumulate([0, *sizes]))
    assert len(sizes) == chunks and min(sizes) > 0 and cuts[-1] == sum(lengths)
    assert set(cuts[:-1]) <= set(starts)
    # never worse than the most uneven choice of cuts by more than one sequence: each cut is at
    # the start nearest its share of the tokens (brute force over every choice of starts)
    best = min(max(b - a for a, b in itertools.pairwise([*c, sum(lengths)]))
               for c in itertools.combinations(starts, chunks) if c[0] == 0)
    assert max(sizes) <= best + max(lengths)


def test_the_cut_is_the_start_nearest_each_share() -> None:
    # 28 tokens in 3: shares at 9.33 and 18.67; the starts are 0, 5, 12, 15, 24
    assert packed_sizes(_positions([5, 7, 3, 9, 4]), 3) == [12, 3, 13]
    assert packed_sizes(_positions([5, 7, 3, 9, 4]), 2) == [15, 13]


def test_a_row_with_fewer_sequences_than_chunks_or_not_one_row_is_one_line() -> None:
    with pytest.raises(MicroBatchError, match=r"^the packed row holds 2 sequence\(s\) .* fewer than "
                                              r"chunks=3: .* use chunks <= 2$"):
        packed_sizes(_positions([4, 4]), 3)
    with pytest.raises(MicroBatchError, match=r"^position_ids of shape \(2, 4\): a packed batch is one row"):
        packed_sizes(torch.zeros(2, 4, dtype=torch.long), 2)


def test_split_then_gather_is_the_row_and_scalars_are_weighted() -> None:
    ids, hidden = torch.arange(10)[None], torch.randn(1, 10, 3)
    per_row, flag = torch.tensor([7]), "constant"
    pieces = split_packed((ids, hidden, per_row, flag), [4, 6])
    assert [p[0].shape[1] for p in pieces] == [4, 6]
    assert all(p[2] is per_row and p[3] == flag for p in pieces)  # not along the sequence: whole
    outs = [{"logits": h * 2, "loss": torch.tensor(float(i + 1))} for i, (_, h, _, _) in enumerate(pieces)]
    got = gather_packed(outs, lambda k: [0.25, 0.75])
    torch.testing.assert_close(got["logits"], hidden * 2)
    assert got["loss"].item() == pytest.approx(0.25 * 1 + 0.75 * 2)
    with pytest.raises(MicroBatchError, match=r"^output leaf 0 has shape \(1,\): .* return \(1, tokens, \.\.\.\)$"):
        gather_packed([torch.ones(1), torch.ones(1)], lambda k: [0.5, 0.5])


def test_padded_rows_hold_each_micro_batch_then_a_sequence_of_their_own() -> None:
    ids, positions = torch.arange(1, 11)[None], _positions([4, 2, 4])
    labels, per_row = ids.clone(), torch.tensor([3])
    rows = packed_rows((ids, positions, labels, per_row), [6, 4], positions=1, labels=2, multiple=8)
    assert rows[0].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 0, 0, 0, 0]]
    assert rows[1].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3]]  # padding: 0, 1, ...
    assert rows[2].tolist() == [[1, 2, 3, 4, 5, 6, -100, -100], [7, 8, 9, 10, -100, -100, -100, -100]]
    assert rows[3].tolist() == [3, 3]  # one value per row, for each row
    # the padding starts a sequence of its own wherever it follows one
    assert [sequence_starts(r[None]) for r in rows[1]] == [[0, 4, 6], [0, 4]]
    logits = torch.randn(2, 8, 5)
    back = unpadded({"logits": logits, "loss": torch.tensor(1.0)}, [6, 4])
    torch.testing.assert_close(back["logits"], torch.cat([logits[:1, :6], logits[1:, :4]], dim=1))
    assert back["loss"].item() == 1.0
