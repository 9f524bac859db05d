"""Scatter a mini-batch into micro-batches and gather the micro-batches' outputs.

A batch of B samples is cut into exactly ``chunks`` micro-batches of the sizes
executor.spec.microbatch_sizes gives ([Note: micro-batch sizes]): they differ by at most one,
the larger first. Exactly M is what the Plan promises; B < M is an error.

Inputs may be tensors or (nested) tuples, lists and dicts of them; every tensor leaf with at
least one dimension is split along dim 0 and must share the batch size. Non-tensor leaves and
0-dim tensors are broadcast to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from executor._torch_compat import tree_flatten, tree_leaves, tree_unflatten
from executor.errors import MicroBatchError
from executor.model_loss import weighted
from executor.spec import microbatch_sizes

__all__ = ["Batch", "scatter", "gather", "batch_size"]

_LEAVES = (int, float, bool, str, type(None))  # exact types pytree never opens


class Batch:
    """The values one micro-batch carries between two stages (the linear-chain convention).

    ``values`` are the next stage's positional arguments. ``atomic`` remembers that the stage
    which produced them returned a single value rather than a tuple, so that :meth:`output`
    hands the last stage's result back exactly as it was returned.
    """

    __slots__ = ("values", "atomic")

    def __init__(self, values: tuple[Any, ...], atomic: bool = False) -> None:
        self.values = values
        self.atomic = atomic

    @classmethod
    def from_output(cls, output: Any) -> Batch:
        """Wrap a stage's return value: a tuple is unpacked into the next call, else not."""
        if isinstance(output, tuple):
            return cls(output, atomic=False)
        return cls((output,), atomic=True)

    def output(self) -> Any:
        """The value the producing stage returned."""
        return self.values[0] if self.atomic else self.values

    def call(self, function: Callable[..., Any]) -> Batch:
        """Call ``function(*values)`` and wrap its result."""
        return Batch.from_output(function(*self.values))

    def _flat(self) -> bool:
        """Whether every value is a leaf itself (a tensor or a plain scalar): the common case,
        where walking the values beats pytree's flatten and unflatten (a few per stage call)."""
        return all(type(v) in _LEAVES or isinstance(v, Tensor) for v in self.values)

    def tensors(self) -> list[Tensor]:
        """Every tensor leaf, in a stable (pytree) order."""
        values = self.values if self._flat() else tree_leaves(self.values)
        return [x for x in values if isinstance(x, Tensor)]

    def with_tensors(self, tensors: Sequence[Tensor]) -> Batch:
        """A batch of the same structure whose tensor leaves are replaced, in order."""
        it = iter(tensors)
        if self._flat():
            return Batch(tuple(next(it) if isinstance(x, Tensor) else x for x in self.values), self.atomic)
        leaves, spec = tree_flatten(self.values)
        new = [next(it) if isinstance(x, Tensor) else x for x in leaves]
        return Batch(tree_unflatten(new, spec), self.atomic)

    def __repr__(self) -> str:
        return f"Batch(values={self.values!r}, atomic={self.atomic})"


def _is_batched(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dim() > 0


def batch_size(inputs: tuple[Any, ...]) -> int:
    """The shared dim-0 size of every batched tensor leaf of ``inputs``."""
    sizes: list[int] = [x.size(0) for x in tree_leaves(inputs) if _is_batched(x)]
    if not sizes:
        raise MicroBatchError(
            "no input tensor has a batch dimension: nothing to split into micro-batches; "
            "pass at least one tensor of shape (batch, ...)"
        )
    if len(set(sizes)) > 1:
        raise MicroBatchError(
            f"inputs have inconsistent batch sizes {sizes} along dim 0: every tensor input is "
            "split into micro-batches; pass non-batched values as non-tensors or 0-dim tensors"
        )
    return sizes[0]


def scatter(inputs: tuple[Any, ...], chunks: int) -> list[Batch]:
    """Split positional ``inputs`` into exactly ``chunks`` micro-batches along dim 0."""
    if isinstance(chunks, int) and chunks < 1:
        raise MicroBatchError(f"chunks={chunks} < 1: need at least one micro-batch; use chunks >= 1")
    try:
        sizes = microbatch_sizes(batch_size(inputs), chunks)
    except ValueError as err:
        raise MicroBatchError(str(err)) from None
    leaves, spec = tree_flatten(inputs)
    parts = [torch.split(x, sizes) if _is_batched(x) else None for x in leaves]
    batches = []
    for i in range(chunks):
        mb = [x if p is None else p[i] for x, p in zip(leaves, parts, strict=True)]
        batches.append(Batch(tree_unflatten(mb, spec)))
    return batches


def gather(outputs: Sequence[Any],
           scalar_weights: Callable[[int], Sequence[Tensor | float]] | None = None) -> Any:
    """Concatenate the micro-batches' outputs (tensors, tuples, dicts) along dim 0.

    Non-tensor leaves are taken from the first micro-batch. A 0-dim tensor leaf ``k`` (a loss)
    is the sum of its micro-batches' values weighted by ``scalar_weights(k)``, one weight per
    micro-batch ([Note: a loss the model computes] in executor/model_loss.py); without
    ``scalar_weights`` it is refused.
    """
    if not outputs:
        raise MicroBatchError("no micro-batch outputs to gather; run at least one micro-batch")
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise MicroBatchError(
                f"micro-batch {i} returned a different structure than micro-batch 0 "
                f"({other} vs {spec}); the last stage must return the same structure every call"
            )
    gathered = []
    for k, first in enumerate(flat[0][0]):
        if not isinstance(first, Tensor):
            gathered.append(first)
            continue
        if first.dim() == 0 and scalar_weights is not None:
            ws = scalar_weights(k)
            gathered.append(torch.stack([weighted(leaves[k], w)
                                         for (leaves, _), w in zip(flat, ws, strict=True)]).sum())
            continue
        if first.dim() == 0:
            raise MicroBatchError(
                f"output leaf {k} is a 0-dim tensor: it cannot be concatenated over micro-batches; "
                "return per-sample values (shape (batch, ...)) and reduce after the pipeline"
            )
        gathered.append(torch.cat([leaves[k] for leaves, _ in flat]))
    return tree_unflatten(gathered, spec)
