"""The messages a cut's wires travel in between two ranks: few, not one per value.

[Note: few messages per cut] PipelineStage sends every tensor it is given as a message of its
own, and every message costs a fixed latency on each side (gloo: a send, a receive, Python
bookkeeping in the schedule). A transformer's cut carries the hidden state plus a mask, a
position tensor and sequence lengths as scalars ([Note: what crosses a cut] in wire.py).
Each of them sent as a message of its own adds that latency per micro-batch and direction,
and costs more under 1F1B than under GPipe, since 1F1B's transfers sit on its critical path
(measured on an empty pipeline: CHANGELOG.md, "Every value crossing a cut was a message of its
own"). So the wires of a cut between two ranks are packed by :func:`layout`:

- a tensor of at least ``ALONE_BYTES`` travels alone (copying it would cost more than the
  latency it saves);
- the smaller tensors that need a gradient travel as one flat tensor per dtype (``torch.cat``
  forward, the split's views backward: autograd routes each gradient home);
- everything else (no gradient: masks, ids, scalars) travels as one byte tensor, each value's
  bytes starting on an 8-byte boundary so that it is viewed back as its dtype without a copy.

A group of one is sent as it is. Both sides compute the same layout from the wires at the
step's input sizes ([Note: wires at other sizes]): the sender in :func:`pack`, the receiver
in :func:`unpack` and in :func:`message_metas`, which gives PipelineStage its buffers. The
cost model charges one latency per cut and direction ([Note: transfer cost] in
autopipe/core/transfer.py), which this makes nearly true.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ALONE_BYTES", "Message", "Slot", "layout", "message_metas", "pack", "unpack"]

ALONE_BYTES = 1 << 16
_ALIGN = 8


@dataclass(frozen=True)
class Message:
    """One message: ``kind`` "alone" (one wire as it is), "cat" (flat, one dtype, with
    gradient) or "bytes" (uint8, no gradient); ``members`` index the cut's sent values."""

    kind: str
    members: tuple[int, ...]


@dataclass(frozen=True)
class Slot:
    """What :func:`layout` needs of one sent value: its shape, dtype and whether it needs a
    gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@functools.lru_cache(maxsize=256)
def layout(slots: tuple[Slot, ...]) -> tuple[Message, ...]:
    """The messages of a cut whose sent values are ``slots`` ([Note: few messages per cut]),
    ordered by their first member (computed once per cut and input size)."""
    alone: list[Message] = []
    cat: dict[torch.dtype, list[int]] = {}
    rest: list[int] = []
    for k, s in enumerate(slots):
        if s.nbytes >= ALONE_BYTES:
            alone.append(Message("alone", (k,)))
        elif s.requires_grad:
            cat.setdefault(s.dtype, []).append(k)
        else:
            rest.append(k)
    groups = [*alone, *(Message("cat", tuple(m)) for m in cat.values())]
    if rest:
        groups.append(Message("bytes", tuple(rest)))
    out = [Message("alone", g.members) if len(g.members) == 1 else g for g in groups]
    return tuple(sorted(out, key=lambda g: g.members[0]))


def message_metas(slots: tuple[Slot, ...], device: torch.device | str = "meta") -> tuple[Tensor, ...]:
    """An example of each message (meta device): the buffers PipelineStage receives into."""
    metas = []
    for msg in layout(slots):
        if msg.kind == "alone":
            s = slots[msg.members[0]]
            metas.append(torch.empty(s.shape, dtype=s.dtype, device=device).requires_grad_(s.requires_grad))
        elif msg.kind == "cat":
            first = slots[msg.members[0]]
            n = sum(slots[k].numel for k in msg.members)
            metas.append(torch.empty(n, dtype=first.dtype, device=device).requires_grad_(True))
        else:
            n = sum(_padded(slots[k].nbytes) for k in msg.members)
            metas.append(torch.empty(n, dtype=torch.uint8, device=device))
    return tuple(metas)


def pack(values: Sequence[Tensor], slots: tuple[Slot, ...]) -> tuple[Tensor, ...]:
    """The messages of ``values`` (a cut's sent values, contiguous, described by ``slots``)."""
    out = []
    for msg in layout(slots):
        if msg.kind == "alone":
            out.append(values[msg.members[0]])
        elif msg.kind == "cat":
            out.append(torch.cat([values[k].reshape(-1) for k in msg.members]))
        else:
            parts = []
            for k in msg.members:
                raw = values[k].detach().reshape(-1).view(torch.uint8)
                pad = _padded(raw.numel()) - raw.numel()
                parts.append(raw)
                if pad:
                    parts.append(raw.new_zeros(pad))
            out.append(torch.cat(parts))
    return tuple(out)


def unpack(messages: Sequence[Tensor], slots: tuple[Slot, ...]) -> list[Tensor]:
    """The cut's sent values from its ``messages``: views, no copies."""
    values: list[Tensor | None] = [None] * len(slots)
    for msg, data in zip(layout(slots), messages, strict=True):
        if msg.kind == "alone":
            values[msg.members[0]] = data
        elif msg.kind == "cat":
            parts = data.split([slots[k].numel for k in msg.members])
            for k, part in zip(msg.members, parts, strict=True):
                values[k] = part.view(slots[k].shape)
        else:
            at = 0
            for k in msg.members:
                s = slots[k]
                values[k] = data[at:at + s.nbytes].view(s.dtype).view(s.shape)
                at += _padded(s.nbytes)
    assert all(v is not None for v in values)
    return [v for v in values if v is not None]
