"""Activation recomputation for pipeline stages, and the autograd plumbing that orders it.

[Note: recompute before the gradient arrives] ``torch.utils.checkpoint`` recomputes a segment
lazily, when its gradient arrives. In a pipeline the recomputation of micro-batch ``i`` on a
stage does not depend on that gradient, so it should be free to run earlier (while the
gradient is still being copied from the next device). Following torchgpipe, a checkpointed
segment is therefore two autograd nodes: :class:`Checkpoint` runs the stage without keeping
activations and, in backward, back-propagates through the recomputed graph; :class:`Recompute`
sits on a side lane (a zero-size "phony" tensor forked from the output and joined back) whose
backward rebuilds the graph, so autograd runs it before :class:`Checkpoint`'s backward.
If no lane ran first (none hangs on an output the loss uses, or the caller adds none, as the
distributed runtime does), :class:`Checkpoint`'s backward recomputes then, as torch's does.
Only the stage's inputs are saved for backward. The RNG states (CPU, and the stage's CUDA
device) are saved in forward and restored in recomputation, so dropout masks replay exactly;
so is the forward's autocast state ([Note: autocast follows the stage] in
executor/precision.py): backward runs on another thread, or outside the caller's ``with
torch.autocast(...)``, and a recomputation without it would rebuild the graph in other dtypes.

:func:`fork`, :func:`join` and :func:`depend` add such ordering-only edges to the autograd
graph; :mod:`executor.local.gpipe` uses :func:`depend` to make micro-batch ``i - 1`` of a stage
back-propagate after micro-batch ``i`` (the fill-drain order, reversed).

[Note: distributed recomputation] The distributed runtime's ``recompute``
(executor/ranks/distributed.py) follows this module's modes, one for every stage or one per stage
([Note: per-stage recomputation] in executor/spec.py): stage ``i`` recomputes the last
``recompute_stop(modes[i])`` micro-batches, whose backward comes last under torch's schedules
([Note: which micro-batches recompute]), never in eval mode or under no_grad (as in
executor.GPipe). It uses this module's own checkpoint (RNG replayed), so a recomputation costs
what it costs in executor.GPipe and what the profile's ``recompute_ratio`` measured there
([Note: layers in sequence]): the forward keeps no graph at all, where torch.utils.checkpoint's
non-reentrant forward still builds one, so its recomputation costs more than executor.GPipe's,
which the profile measures (CHANGELOG.md, "Recomputation on 2 ranks used torch's non-reentrant
checkpoint"). A PipelineStage receives a gradient before it starts a micro-batch's backward,
so there is nothing to overlap the recomputation with: it runs when the gradient arrives, without
executor.recompute's early-recompute lane. Under the zero-bubble schedules the recomputed graph
is back-propagated in two halves, the inputs' gradients then and the weights' at the W
(``split=``, [Note: split backward on ranks] in executor/ranks/split_backward.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from executor.errors import ExecutorError
from executor.microbatch import Batch
from executor.precision import AutocastState
from executor.spec import recomputed_microbatches

__all__ = [
    "recompute_stop",
    "is_checkpointing",
    "is_recomputing",
    "Checkpointing",
    "get_phony",
    "fork",
    "join",
    "depend",
]

StageFn = Callable[[Batch], Batch]
SpanFactory = Callable[[], AbstractContextManager[Any]]
# a split backward ([Note: split backward on ranks] in executor/ranks/split_backward.py): the inputs'
# gradients from the recomputed outputs, their gradients and the inputs, the weights' later
SplitFn = Callable[[list[Tensor], tuple[Tensor | None, ...], list[Tensor]], list[Tensor | None]]


def recompute_stop(mode: str, chunks: int, *, enabled: bool = True) -> int:
    """Micro-batches ``0 .. stop-1`` are checkpointed; ``enabled=False`` (eval, no_grad) -> 0."""
    try:
        recomputed = recomputed_microbatches(mode, chunks)
    except ValueError as err:
        raise ExecutorError(str(err)) from None
    return recomputed if enabled else 0


class _Flags(threading.local):
    checkpointing = False
    recomputing = False


_flags = _Flags()


def is_checkpointing() -> bool:
    """True while a stage runs its checkpointed (activation-free) forward in this thread."""
    return _flags.checkpointing


def is_recomputing() -> bool:
    """True while a stage is being recomputed in this thread: skip side effects (BN stats)."""
    return _flags.recomputing


@contextmanager
def _flag(name: str) -> Iterator[None]:
    old = getattr(_flags, name)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, old)


# --- phony lanes -------------------------------------------------------------------------

_phonies: dict[tuple[torch.device, bool], Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """A cached zero-size tensor; detach it before returning it from an autograd function."""
    key = (device, requires_grad)
    if key not in _phonies:
        _phonies[key] = torch.empty(0, device=device, requires_grad=requires_grad)
    return _phonies[key]


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.detach(), get_phony(x.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _phony_grad: Tensor | None) -> Tensor:
        return grad


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, phony: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fork(x: Tensor) -> tuple[Tensor, Tensor]:
    """Branch a phony lane off ``x``: ``x``'s backward waits for the lane's backward too."""
    if torch.is_grad_enabled() and x.requires_grad:
        out, phony = _Fork.apply(x)
        return out, phony
    return x, get_phony(x.device, requires_grad=False)


def join(x: Tensor, phony: Tensor) -> Tensor:
    """Merge a phony lane into ``x``: the lane's backward runs once ``x``'s gradient exists."""
    if torch.is_grad_enabled() and (x.requires_grad or phony.requires_grad):
        out: Tensor = _Join.apply(x, phony)
        return out
    return x


def _first_grad_index(tensors: list[Tensor]) -> int | None:
    return next((k for k, t in enumerate(tensors) if t.requires_grad), None)


def depend(before: Batch, after: Batch) -> tuple[Batch, Batch]:
    """Order backward so that ``before`` back-propagates after ``after`` has.

    Only batches already in the autograd graph are tied; joining into a tensor that does not
    require grad would make autograd compute a gradient nobody asked for.
    """
    tb, ta = before.tensors(), after.tensors()
    kb, ka = _first_grad_index(tb), _first_grad_index(ta)
    if kb is None or ka is None or not torch.is_grad_enabled():
        return before, after
    tb[kb], phony = fork(tb[kb])
    ta[ka] = join(ta[ka], phony)
    return before.with_tensors(tb), after.with_tensors(ta)


# --- checkpoint / recompute --------------------------------------------------------------

RNGState = tuple[Tensor, Tensor | None]


def _save_rng(device: torch.device) -> RNGState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _restored_rng(device: torch.device, state: RNGState) -> Iterator[None]:
    cpu, cuda = state
    with torch.random.fork_rng([device] if device.type == "cuda" else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class _Shared:
    """State one checkpointed (stage, micro-batch) shares between its two autograd nodes."""

    def __init__(
        self, function: StageFn, batch: Batch, device: torch.device, span: SpanFactory,
        split: SplitFn | None = None,
    ) -> None:
        self.function = function
        self.batch = batch  # input structure; its tensors are replaced on each call
        self.device = device
        self.span = span
        self.split = split
        self.rng: RNGState | None = None
        self.autocast = AutocastState.capture()  # the forward's: Checkpointing is made where it runs
        self.output: Batch | None = None  # the first run's output, until checkpoint() takes it
        self.recomputed: tuple[list[Tensor], list[Tensor]] | None = None  # (outputs, input leaves)


def _mark_integers(ctx: Any, tensors: tuple[Tensor, ...]) -> None:
    ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, shared: _Shared, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.shared = shared
        # an output the loss never uses must give its parameters no gradient (None), not zeros:
        # AdamW would otherwise decay them, and the unpipelined model would not
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)  # the same tensors _Recompute keeps: no extra memory
        shared.rng = _save_rng(shared.device)
        with torch.no_grad(), _flag("checkpointing"):
            shared.output = shared.function(shared.batch.with_tensors(inputs))
        # a stage may return a parameter itself (x.to(x.dtype) is x): as this node's output it
        # would get this node's grad_fn and stop being a leaf, so it leaves as a view of itself
        outputs = tuple(t.view_as(t) if t.is_leaf and t.requires_grad else t
                        for t in shared.output.tensors())
        _mark_integers(ctx, outputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        shared: _Shared = ctx.shared
        if shared.recomputed is None:  # no lane ran first: recompute now, as torch's checkpoint does
            _recompute(shared, ctx.saved_tensors)
        assert shared.recomputed is not None
        outputs, leaves = shared.recomputed
        shared.recomputed = None
        if shared.split is not None:  # under a zero-bubble schedule: the weights' part later
            return (None, None, *shared.split(outputs, grads, leaves))
        pairs = [
            (y, g) for y, g in zip(outputs, grads, strict=True) if y.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in leaves])


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, shared: _Shared, *inputs: Tensor) -> Tensor:
        ctx.shared = shared
        ctx.save_for_backward(*inputs)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, *_: Tensor | None) -> tuple[None, ...]:
        saved = ctx.saved_tensors
        _recompute(ctx.shared, saved)
        return (None, None, *[None for _ in saved])


def _recompute(shared: _Shared, saved: tuple[Tensor, ...]) -> None:
    """Run the stage again on its saved inputs, with grad and the forward's RNG state and
    autocast state."""
    leaves = [x.detach().requires_grad_(x.requires_grad) for x in saved]
    assert shared.rng is not None
    with shared.span(), _restored_rng(shared.device, shared.rng):
        with torch.enable_grad(), _flag("recomputing"), shared.autocast.apply():
            out = shared.function(shared.batch.with_tensors(leaves))
    shared.recomputed = (out.tensors(), leaves)


class Checkpointing:
    """Run one (stage, micro-batch) without keeping activations; recompute them in backward.

    ``function`` maps the input :class:`Batch` to the output :class:`Batch` and must behave
    the same on both calls (RNG is replayed). ``span`` times the recomputation (tracing).
    ``split``, given, back-propagates the recomputed graph instead of a whole backward (the
    distributed runtime's zero-bubble schedules: executor/ranks/split_backward.py).
    """

    def __init__(
        self,
        function: StageFn,
        batch: Batch,
        device: torch.device,
        span: SpanFactory = nullcontext,
        split: SplitFn | None = None,
    ) -> None:
        self._shared = _Shared(function, batch, device, span, split)

    def checkpoint(self) -> Batch:
        """The forward pass: outputs that require grad, with no activations saved."""
        shared = self._shared
        phony = get_phony(shared.device, requires_grad=True)  # keeps the node in the graph
        outputs = _Checkpoint.apply(phony, shared, *shared.batch.tensors())
        assert shared.output is not None
        result = shared.output.with_tensors(outputs)
        # Its tensors are the node's own outputs, whose grad_fn holds ctx.shared: kept here, that
        # cycle runs through C++ autograd nodes, which Python's gc cannot see, and every
        # checkpointed micro-batch's outputs would stay alive forever.
        shared.output = None
        return result

    def recompute(self, batch: Batch) -> Batch:
        """Hang the recomputation on a side lane of ``batch`` (this node's output)."""
        shared = self._shared
        tensors = batch.tensors()
        k = _first_grad_index(tensors)
        if k is None or not torch.is_grad_enabled():
            return batch  # nothing will back-propagate through this node
        tensors[k], phony = fork(tensors[k])
        phony = _Recompute.apply(phony, shared, *shared.batch.tensors())
        tensors[k] = join(tensors[k], phony)
        return batch.with_tensors(tensors)
