"""A packed row split into micro-batches at sequence starts, and its outputs joined back.

    sizes = packed_sizes(position_ids, chunks)       # tokens per micro-batch, cut at sequence starts
    pieces = split_packed(inputs, sizes)             # every (1, T, ...) input cut along dim 1
    out = gather_packed(outputs, weights)            # (1, T_i, ...) outputs joined along dim 1
    rows = packed_rows(inputs, sizes, positions=k, labels=j)   # ... as equal rows, for ranks
    out = unpadded(output, sizes)                    # (chunks, L, ...) outputs back to (1, T, ...)

[Note: packed rows split at sequence starts] A packing collator (HuggingFace's
``DataCollatorWithFlattening``) puts a batch's sequences end to end in ONE row, without padding,
with ``position_ids`` that restart at each sequence; the model attends within each sequence only
(transformers finds the sequences from the positions: a position that is not its predecessor's
plus one starts one). One row cannot be split by rows, so a pipeline cuts it along the sequence
instead, between whole sequences: micro-batch ``i`` is the row's tokens ``[c_i, c_{i+1})``, each
cut at a sequence start, the cuts placed to give the micro-batches as equal token counts as the
sequence lengths allow (each cut at the start nearest its share ``i * T / chunks``, and never
two at one start). Every token then sees what it sees in the whole row: its own sequence and
its own positions. The loss is the same sum over the same tokens when the collator has ignored
each sequence's first label (its ``-100`` separator), because the label a micro-batch's last
token would predict across the cut is that ignored one; the pipeline checks this from the
model's own count of its loss items (executor/local/gpipe.py), so a row packed without
separators is refused in one line rather than trained on a different loss. The model's loss is
weighted by each micro-batch's counted tokens as for rows ([Note: a loss the model computes] in
executor/model_loss.py), and other 0-dim outputs by each micro-batch's share of the tokens.

[Note: packed rows on ranks] torch's schedules split a batch into equal slices of rows, so on
ranks the micro-batches become ``chunks`` rows of one length ``L``: micro-batch ``i``, then
padding that is a sequence of its own (positions 0, 1, ...: no real token attends to it, nor it
to them), labels ignored (-100), other values 0. Its tokens add nothing to the loss, so nothing
to any gradient. ``L`` is fixed when the pipeline is built: its example's longest micro-batch
rounded up to a multiple of :data:`PAD_MULTIPLE`. Every later batch pads to that ``L``, whatever
its total length, so every step runs the stages built for the example; HuggingFace's packed
attention mask fixes the sequence length of the traced stages anyway (Llama's does: a stage
built for 64 tokens refuses 128). A batch with a longer micro-batch is refused in one line. The
model's outputs come back without the padding (:func:`unpadded`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from executor._torch_compat import tree_flatten, tree_unflatten
from executor.errors import MicroBatchError
from executor.model_loss import ModelLoss, weighted

__all__ = ["POSITIONS", "LABELS", "PAD_MULTIPLE", "packed_sizes", "split_packed", "gather_packed",
           "packed_rows", "as_rows", "unpadded", "check_separators"]

POSITIONS = "position_ids"  # the keyword input whose restarts mark the sequences (HuggingFace's name)
LABELS = "labels"  # the keyword input a padding token's label goes to: IGNORED
IGNORED = -100  # HuggingFace's ignore_index, which DataCollatorWithFlattening writes too
PAD_MULTIPLE = 64  # rows on ranks are padded to a multiple of this many tokens


def sequence_starts(position_ids: Tensor) -> list[int]:
    """Where each sequence of a ``(1, T)`` row of positions starts (0 first): where a position is
    not its predecessor's plus one, as transformers' ``find_packed_sequence_indices`` reads them."""
    row = position_ids.reshape(-1).to("cpu", torch.int64)
    if row.numel() == 0:
        return []
    steps = torch.diff(row) != 1
    return [0, *(torch.nonzero(steps).reshape(-1) + 1).tolist()]


def packed_sizes(position_ids: Tensor, chunks: int) -> list[int]:
    """The token count of each of ``chunks`` micro-batches of one packed row, cut at sequence
    starts as evenly as the sequences allow (see [Note: packed rows split at sequence starts])."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise MicroBatchError(f"{POSITIONS} of shape {tuple(position_ids.shape)}: a packed batch is "
                              "one row, shape (1, tokens)")
    starts = sequence_starts(position_ids)
    total = int(position_ids.shape[1])
    if len(starts) < chunks:
        raise MicroBatchError(
            f"the packed row holds {len(starts)} sequence(s) ({POSITIONS} restart {len(starts)} "
            f"time(s)), fewer than chunks={chunks}: a micro-batch is whole sequences; pack at least "
            f"{chunks} sequences per batch or use chunks <= {max(len(starts), 1)}")
    cuts = [0]
    for i in range(1, chunks):
        # the start nearest this cut's share, leaving one start for every later micro-batch
        lo = starts.index(cuts[-1]) + 1
        hi = len(starts) - (chunks - i)
        cuts.append(min(starts[lo:hi + 1], key=lambda s: (abs(s - i * total / chunks), s)))
    cuts.append(total)
    return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]


def split_packed(inputs: tuple[Any, ...], sizes: Sequence[int]) -> list[tuple[Any, ...]]:
    """``inputs`` (one packed row) as ``len(sizes)`` micro-batches: every tensor leaf of shape
    ``(1, T, ...)`` cut along dim 1 into ``sizes``; other leaves (a ``(1,)`` per-row value, a
    scalar, a non-tensor) go to every micro-batch unchanged."""
    total = sum(sizes)
    leaves, spec = tree_flatten(inputs)
    parts = [torch.split(x, list(sizes), dim=1)
             if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] == total else None
             for x in leaves]
    return [tree_unflatten([x if p is None else p[i] for x, p in zip(leaves, parts, strict=True)], spec)
            for i in range(len(sizes))]


def gather_packed(outputs: Sequence[Any],
                  scalar_weights: Callable[[int], Sequence[Tensor | float]]) -> Any:
    """The micro-batches' outputs of one packed row joined back: tensors of two or more dims
    along dim 1 (the sequence), a 0-dim leaf ``k`` as the sum of its values weighted by
    ``scalar_weights(k)``, non-tensors from the first micro-batch."""
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise MicroBatchError("the micro-batches of a packed row returned different structures; "
                              "the last stage must return the same structure every call")
    gathered = []
    for k, first in enumerate(flat[0][0]):
        if not isinstance(first, Tensor):
            gathered.append(first)
        elif first.dim() == 0:
            gathered.append(torch.stack([weighted(leaves[k], w) for (leaves, _), w
                                         in zip(flat, scalar_weights(k), strict=True)]).sum())
        elif first.dim() >= 2:
            gathered.append(torch.cat([leaves[k] for leaves, _ in flat], dim=1))
        else:
            raise MicroBatchError(
                f"output leaf {k} has shape {tuple(first.shape)}: a packed row's outputs are joined "
                "along the sequence (dim 1), which a 1-dim value does not have; return (1, tokens, ...)")
    return tree_unflatten(gathered, spec)


def _on_sequence(x: Any, total: int) -> bool:
    return isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] == total


def packed_rows(inputs: tuple[Any, ...], sizes: Sequence[int], positions: int,
                labels: int | None = None, multiple: int = PAD_MULTIPLE) -> tuple[Any, ...]:
    """One packed row (flat ``inputs``) as ``len(sizes)`` padded rows of one length ([Note:
    packed rows on ranks]); ``positions`` and ``labels``: the indices of those inputs."""
    total, chunks = sum(sizes), len(sizes)
    length = -(-max(sizes) // multiple) * multiple
    pieces = split_packed(inputs, sizes)
    rows: list[Any] = []
    for k, x in enumerate(inputs):
        if not _on_sequence(x, total):
            batched = isinstance(x, Tensor) and x.dim() == 1 and x.shape[0] == 1
            rows.append(x.expand(chunks) if batched else x)
            continue
        padded = []
        for piece, n in zip(pieces, sizes, strict=True):
            shape = (1, length - n, *x.shape[2:])
            if k == positions:
                pad = torch.arange(length - n, dtype=x.dtype, device=x.device).reshape(shape)
            else:
                pad = torch.full(shape, IGNORED if k == labels else 0, dtype=x.dtype, device=x.device)
            padded.append(torch.cat([piece[k], pad], dim=1))
        rows.append(torch.cat(padded))
    return tuple(rows)


def as_rows(inputs: tuple[Any, ...], names: Sequence[str], chunks: int,
            length: int | None = None) -> tuple[tuple[Any, ...], list[int]]:
    """One packed row (flat ``inputs``, its last ``len(names)`` the keyword inputs of these
    names) as ``chunks`` padded rows and each micro-batch's tokens ([Note: packed rows on
    ranks]): rows of ``length`` tokens, refused in one line when a micro-batch needs more, or
    without one of the longest micro-batch rounded up to :data:`PAD_MULTIPLE`."""
    first, names = len(inputs) - len(names), list(names)
    positions = first + names.index(POSITIONS)
    sizes = packed_sizes(inputs[positions], chunks)
    if length is not None and max(sizes) > length:
        raise MicroBatchError(
            f"a micro-batch of the packed row holds {max(sizes)} tokens, more than the {length} of "
            "the rows this pipeline was built for: build it with your longest packed batch as "
            "example_kwargs, or use more chunks")
    labels = first + names.index(LABELS) if LABELS in names else None
    return packed_rows(inputs, sizes, positions, labels, multiple=length or PAD_MULTIPLE), sizes


def unpadded(output: Any, sizes: Sequence[int]) -> Any:
    """The outputs of :func:`packed_rows`' rows as of the packed row: every ``(rows, L, ...)``
    tensor leaf's real tokens joined along dim 1 into ``(1, T, ...)``; other leaves as they are."""
    leaves, spec = tree_flatten(output)
    joined = [torch.cat([x[i:i + 1, :n] for i, n in enumerate(sizes)], dim=1)
              if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[0] == len(sizes) else x
              for x in leaves]
    return tree_unflatten(joined, spec)


def check_separators(loss: ModelLoss, row: tuple[Any, ...], parts: Sequence[tuple[Any, ...]]) -> None:
    """MicroBatchError unless the model's loss counts as many items in ``parts`` as in the whole
    packed ``row``: a label counted across a cut between micro-batches would be lost."""
    if loss.weights([row], 1.0).sum() != loss.weights(parts, 1.0).sum():
        raise MicroBatchError(
            "the packed row's labels count a token across a cut between sequences: a packed "
            "batch ignores each sequence's first label (-100, as DataCollatorWithFlattening "
            "writes it), or the micro-batches' loss differs from the row's; pack with "
            "separators or use chunks=1")
