"""A step's inputs on one rank: bound, checked, their sizes agreed, and the schedule for them.

    inputs, target = bind_inputs(pipe, inputs, keywords, target)   # keywords in stage 0's order
    schedule = schedule_for(pipe, inputs, target, need_target=True)  # the same size on every rank

Used by :class:`executor.ranks.distributed.DistributedPipeline`'s ``step`` and ``eval_step``.
Only the first stage reads the inputs and only the last the target; the model's own loss
([Note: a loss the model computes] in executor/model_loss.py) needs the inputs on the last rank
too, which counts its micro-batches' items from them. Rank 0's sizes pick every rank's schedule
([Note: one schedule per input size] in executor/ranks/sized.py).

``num_items_in_batch=N`` among the keywords is HuggingFace's: the model's loss is over N items,
those of every batch the caller accumulates into one optimizer step (and, with replicas, of
every replica's), as ``executor.GPipe`` and the model itself take it. Pass it on every rank or
on none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from executor.errors import DistributedError, MicroBatchError
from executor.model_loss import ModelLoss
from executor.packed import POSITIONS, as_rows, check_separators, split_packed
from executor.ranks.sized import microbatch_sizes_of

if TYPE_CHECKING:
    from executor.ranks.distributed import DistributedPipeline

__all__ = ["bind_inputs", "schedule_for", "check_batch"]


def bind_inputs(pipe: DistributedPipeline, inputs: tuple[Any, ...], keywords: dict[str, Any],
                target: Any) -> tuple[tuple[Any, ...], Any]:
    """Keyword inputs in stage 0's order, and the target: the model's loss weights x chunks."""
    total = keywords.pop("num_items_in_batch", None)
    if total is not None and not isinstance(pipe._loss_fn, ModelLoss):
        raise DistributedError("num_items_in_batch is for the model's own loss, and this pipeline's loss "
                               "is the caller's loss_fn: leave it out, or build the pipeline without loss_fn")
    pipe._num_items = None if total is None else float(total)
    if pipe.signature is not None and (inputs or keywords):
        inputs = pipe.signature.bind(inputs, keywords)
    elif keywords:
        raise DistributedError(f"keyword input {next(iter(keywords))!r}: this pipeline takes "
                               "keyword inputs only with signature=InputSignature(...)")
    inputs = _as_rows(pipe, inputs, target)
    loss_fn = pipe._loss_fn
    if not isinstance(loss_fn, ModelLoss) or not pipe.is_last:
        return inputs, target
    if target is not None:
        raise DistributedError("the model computes its own loss: call step(**batch) without target=")
    if not inputs:
        raise DistributedError("the model computes its own loss, which the last rank weights by "
                               "the items its micro-batches count: pass the batch on every rank")
    check_batch(inputs, "inputs", pipe.chunks)
    target, pipe._counted = loss_fn.schedule_targets(inputs, pipe.chunks, pipe.device, pipe._num_items)
    return inputs, target


def _as_rows(pipe: DistributedPipeline, inputs: tuple[Any, ...], target: Any) -> tuple[Any, ...]:
    """One packed row as padded rows ([Note: packed rows on ranks] in executor/packed.py), its
    micro-batches' sizes kept for eval_step's output; any other batch as it is."""
    pipe._packed = None
    sig = pipe.signature
    rows = [x.shape[0] for x in inputs if isinstance(x, Tensor) and x.dim() > 0]
    if sig is None or POSITIONS not in sig.keywords or pipe.chunks == 1 or rows[:1] != [1]:
        return inputs
    if target is not None:
        raise DistributedError("a packed row is split with the model's own labels=, not target=: "
                               "pass the labels as a keyword input")
    at = sig.positional + sig.keywords.index(POSITIONS)
    length = (pipe._sized.example[at] or (0,))[-1]  # the example's rows' length: every step's
    try:
        padded, sizes = as_rows(inputs, sig.keywords, pipe.chunks, length)
        if isinstance(pipe._loss_fn, ModelLoss):
            check_separators(pipe._loss_fn, inputs, split_packed(inputs, sizes))
    except MicroBatchError as err:
        raise DistributedError(str(err)) from None
    pipe._packed = sizes
    return padded


def schedule_for(pipe: DistributedPipeline, inputs: tuple[Any, ...], target: Any, *,
                 need_target: bool) -> Any:
    """Check this step's inputs, agree on their sizes, and pick the schedule for them."""
    problem, sizes = "", None
    if pipe.is_first:
        try:
            check_batch(inputs, "inputs", pipe.chunks)
            sizes = microbatch_sizes_of(inputs, pipe.chunks)
        except DistributedError as err:
            problem = str(err)
        if not inputs:
            problem = "rank 0 runs stage 0 and needs the inputs: step(*inputs, target=y) on every rank"
    if pipe.is_last and need_target:
        if target is None:
            raise DistributedError("the last rank needs target=...: step(*inputs, target=y) on every rank")
        check_batch((target,), "target", pipe.chunks)
    return pipe._sized.get(pipe._sized.agree(sizes, problem))


def check_batch(values: Sequence[Any], what: str, chunks: int) -> None:
    """DistributedError unless every batched tensor in ``values`` splits into ``chunks`` equal parts."""
    for v in values:
        if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] % chunks:
            raise DistributedError(
                f"{what} batch size {v.shape[0]} is not a multiple of chunks={chunks}: "
                "PipelineStage needs equal micro-batches; use a batch divisible by chunks"
            )
