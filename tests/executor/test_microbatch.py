from __future__ import annotations

import pytest
import torch

from executor.errors import MicroBatchError
from executor.microbatch import Batch, batch_size, gather, scatter


def test_scatter_tensor_exactly_chunks_uneven() -> None:
    x = torch.arange(10).reshape(10, 1)
    batches = scatter((x,), 4)
    assert [b.values[0].shape[0] for b in batches] == [3, 3, 2, 2]
    torch.testing.assert_close(torch.cat([b.values[0] for b in batches]), x)
    assert all(isinstance(b.values, tuple) and not b.atomic for b in batches)


def test_scatter_nested_tuples_dicts_and_broadcast() -> None:
    x = torch.randn(6, 3)
    y = torch.randn(6)
    scale = torch.tensor(2.0)  # 0-dim: broadcast
    inputs = (x, {"y": y, "pair": (y, 7)}, "mode", scale)
    batches = scatter(inputs, 3)
    assert len(batches) == 3
    for i, b in enumerate(batches):
        bx, bd, mode, bs = b.values
        torch.testing.assert_close(bx, x[2 * i : 2 * i + 2])
        torch.testing.assert_close(bd["y"], y[2 * i : 2 * i + 2])
        torch.testing.assert_close(bd["pair"][0], y[2 * i : 2 * i + 2])
        assert bd["pair"][1] == 7 and mode == "mode" and bs is scale


def test_gather_tensor_tuple_dict_and_non_tensor() -> None:
    x = torch.randn(7, 2)
    parts = torch.tensor_split(x, 3)
    torch.testing.assert_close(gather(list(parts)), x)
    out = gather([(p, {"h": p * 2, "n": 5}) for p in parts])
    torch.testing.assert_close(out[0], x)
    torch.testing.assert_close(out[1]["h"], x * 2)
    assert out[1]["n"] == 5


def test_scatter_gather_round_trip_is_identity() -> None:
    x = torch.randn(5, 4)
    batches = scatter((x,), 5)
    torch.testing.assert_close(gather([b.values[0] for b in batches]), x)


def test_batch_tensors_and_with_tensors_keep_structure() -> None:
    a, b = torch.ones(2), torch.zeros(2)
    batch = Batch((a, 3, {"b": b}))
    assert batch.tensors() == [a, b]
    new = batch.with_tensors([a + 1, b + 1])
    assert new.values[1] == 3
    torch.testing.assert_close(new.values[2]["b"], b + 1)
    assert Batch.from_output(a).atomic and Batch.from_output(a).output() is a
    assert Batch.from_output((a, 3)).output() == (a, 3)


def test_flat_batches_take_the_short_path_to_the_same_answer() -> None:
    # values that are leaves themselves skip pytree; anything it would open does not
    a, b = torch.ones(2), torch.zeros(3)
    flat = Batch((a, 3, None, "x", 1.5, True, b), atomic=False)
    assert flat._flat() and flat.tensors() == [a, b]
    swapped = flat.with_tensors([b, a])
    assert swapped.values[0] is b and swapped.values[1:6] == (3, None, "x", 1.5, True) and swapped.values[6] is a
    for nested in (Batch((a, (b,))), Batch((a, [b])), Batch(({"k": b}, a))):
        assert not nested._flat()
        assert {id(t) for t in nested.tensors()} == {id(a), id(b)}


def test_chunks_greater_than_batch_size() -> None:
    with pytest.raises(MicroBatchError, match=r"chunks=8 > batch size 4: .*use chunks <= 4"):
        scatter((torch.randn(4, 2),), 8)


def test_chunks_below_one() -> None:
    with pytest.raises(MicroBatchError, match=r"chunks=0 < 1"):
        scatter((torch.randn(4, 2),), 0)


def test_inconsistent_batch_sizes() -> None:
    with pytest.raises(MicroBatchError, match=r"inconsistent batch sizes \[4, 3\]"):
        batch_size((torch.randn(4, 2), torch.randn(3, 2)))


def test_no_batched_tensor() -> None:
    with pytest.raises(MicroBatchError, match="no input tensor has a batch dimension"):
        scatter((1, torch.tensor(2.0)), 1)


def test_gather_rejects_scalars_and_mismatched_structures() -> None:
    with pytest.raises(MicroBatchError, match="0-dim tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(MicroBatchError, match="different structure"):
        gather([torch.ones(1), (torch.ones(1),)])
    with pytest.raises(MicroBatchError, match="no micro-batch outputs"):
        gather([])
