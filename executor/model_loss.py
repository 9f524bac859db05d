"""A loss the model computes itself, weighted per micro-batch as on the whole batch.

[Note: a loss the model computes] A model called with labels (HuggingFace's ``labels=``) returns
the mean of a loss over the items it counts: the target tokens that are not ``ignore_index``.
Run per micro-batch, micro-batch ``i`` returns ``L_i``, the mean over its own ``n_i`` counted
items, and the whole batch's loss is ``sum(n_i * L_i) / N`` with ``N = sum(n_i)`` (HuggingFace's
``num_items_in_batch``), not the plain mean of the ``L_i``: padding and ignored labels are rarely
spread evenly over micro-batches. :class:`ModelLoss` names the output leaf that is such a loss
and how to count a micro-batch's items from its inputs (``count(*inputs)``), so the weights
``n_i / N`` are known before any micro-batch runs. That matters under 1F1B, where a
micro-batch's backward starts before later forwards (executor/ranks/distributed.py); in one process
executor.GPipe builds the weighted sum when it gathers the outputs (executor.microbatch.gather),
and the user's ``out.loss.backward()`` back-propagates the right weight into each micro-batch.
Every other 0-dim output (an auxiliary loss) is weighted by the micro-batch's share of rows
(:func:`row_weights`): right for a mean over samples. A micro-batch with nothing counted
(every label ignored) has a NaN mean of its own but weight 0: :func:`weighted` leaves it out of
the sum (and its gradient 0), as the whole batch's mean does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from executor._torch_compat import tree_leaves
from executor.errors import MicroBatchError

__all__ = ["ModelLoss", "row_weights", "weighted"]


@dataclass(frozen=True)
class ModelLoss:
    """Output leaf ``leaf`` (pytree order) is a mean over the items ``count(*inputs)`` counts."""

    leaf: int
    count: Callable[..., Tensor]

    def weights(self, batches: Sequence[tuple[Any, ...]], total: float | None = None) -> Tensor:
        """``n_i / N`` for micro-batches of these inputs (float64, on the CPU); ``total``: the
        ``N`` to divide by instead of the batch's own count (HuggingFace's
        ``num_items_in_batch``: the items of every batch a step accumulates)."""
        return self._normalised(self._counts(batches), total)

    def _counts(self, batches: Sequence[tuple[Any, ...]]) -> Tensor:
        """Each micro-batch's counted items (float64, on the CPU)."""
        with torch.no_grad():
            return torch.stack([self.count(*b).detach().to("cpu", torch.float64).reshape(()) for b in batches])

    @staticmethod
    def _normalised(counts: Tensor, total: float | None) -> Tensor:
        if total is not None:
            if not total > 0:
                raise MicroBatchError(f"num_items_in_batch={total}: the items counted over the "
                                      "accumulated batches must be positive")
            return counts / total
        whole = counts.sum()
        if whole == 0:
            raise MicroBatchError("the batch has no counted items (every label is the loss's "
                                  "ignore_index): its loss is undefined; pass a batch with labels")
        return counts / whole

    def schedule_targets(self, inputs: tuple[Any, ...], chunks: int, device: torch.device,
                         total: float | None = None) -> tuple[Tensor, float]:
        """The per-micro-batch targets a torch schedule splits out of ``inputs``' equal
        micro-batches: each one's weight x ``chunks``, since the schedule averages the losses
        (executor/ranks/distributed.py's ``step``); and the items the batch counts, which
        replicas add up ([Note: tokens over replicas] in executor/ranks/replicated.py).
        ``total``: as in :meth:`weights`."""
        parts = [tuple(p) for p in zip(*(x.tensor_split(chunks) if isinstance(x, Tensor) and x.dim()
                                         else [x] * chunks for x in inputs), strict=True)]
        counts = self._counts(parts)
        return (self._normalised(counts, total) * chunks).to(device), float(counts.sum())

    def pick(self, output: Any) -> Tensor:
        """The loss leaf of a micro-batch's output."""
        value = tree_leaves(output)[self.leaf]
        assert isinstance(value, Tensor) and value.dim() == 0, "ModelLoss.leaf is a 0-dim tensor"
        return value


def row_weights(sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the batch's rows."""
    total = sum(sizes)
    return [s / total for s in sizes]


def weighted(value: Tensor, weight: Tensor | float) -> Tensor:
    """``value * weight``, and 0 (gradient 0) where ``weight`` is 0 even if ``value`` is NaN."""
    w = torch.as_tensor(weight, dtype=value.dtype, device=value.device).reshape(())
    return torch.where(w > 0, value * w, torch.zeros((), dtype=value.dtype, device=value.device))
