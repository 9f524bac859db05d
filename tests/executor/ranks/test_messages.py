"""[Note: few messages per cut]: a cut's values packed into few messages and back, exactly."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from executor.ranks.messages import ALONE_BYTES, Message, Slot, layout, message_metas, pack, unpack


def _slot(t: torch.Tensor) -> Slot:
    return Slot(tuple(t.shape), t.dtype, t.requires_grad)


def _values() -> list[torch.Tensor]:
    big = torch.randn(ALONE_BYTES // 4, requires_grad=True)  # exactly ALONE_BYTES: alone
    return [
        torch.randn(2, 3, 4, requires_grad=True),  # hidden state
        torch.tensor(7),  # a sequence length (a 0-d int64 scalar on the wire)
        torch.rand(2, 1, 3, 3) > 0.5,  # a mask: bool
        big,
        torch.randn(2, 3, 4, requires_grad=True),  # a residual
        torch.randn(5, dtype=torch.float16),  # no gradient, 10 bytes: padded to 16
        torch.arange(3),  # ids
    ]


def test_layout_sends_big_values_alone_the_rest_in_one_message_each_kind() -> None:
    slots = tuple(_slot(v) for v in _values())
    assert layout(slots) == (Message("cat", (0, 4)), Message("bytes", (1, 2, 5, 6)), Message("alone", (3,)))
    # a group of one travels as it is; nothing to pack, nothing sent
    assert layout(slots[:1]) == (Message("alone", (0,)),)
    assert layout(()) == ()


def test_pack_unpack_round_trip_and_metas_match() -> None:
    values = _values()
    slots = tuple(_slot(v) for v in values)
    messages = pack(values, slots)
    assert len(messages) == 3
    for got, meta in zip(messages, message_metas(slots), strict=True):
        assert (got.shape, got.dtype, got.requires_grad) == (meta.shape, meta.dtype, meta.requires_grad)
    # what PipelineStage receives: fresh buffers, detached leaves where a gradient comes back
    received = [m.detach().clone().requires_grad_(m.requires_grad) for m in messages]
    back = unpack(received, slots)
    for a, b in zip(back, values, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach(), b.detach())


def test_gradients_reach_each_value_through_its_message() -> None:
    values = _values()
    slots = tuple(_slot(v) for v in values)
    received = [m.detach().clone().requires_grad_(m.requires_grad) for m in pack(values, slots)]
    hidden, _, mask, big, residual, _, _ = unpack(received, slots)
    loss = (hidden * 2).sum() + (residual * mask.float().sum()).sum() + big.square().sum()
    loss.backward()
    cat = received[0].grad
    assert cat is not None
    assert_close(cat[:24], torch.full((24,), 2.0))
    assert_close(cat[24:], torch.full((24,), float(mask.sum())))
    assert_close(received[2].grad, 2 * big.detach())
    # the sender's side: the gradient of the packed message flows to every value in it
    messages = pack(values, slots)
    torch.autograd.backward([messages[0], messages[2]], [cat, received[2].grad])
    assert_close(values[0].grad, torch.full((2, 3, 4), 2.0))
    assert_close(values[3].grad, 2 * big.detach())
