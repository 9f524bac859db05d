"""The zero-bubble schedules on our stages: each backward in two, input gradients first, the
weight gradients later.

[Note: split backward on ranks] torch's zero-bubble schedules (``ZERO_BUBBLE_SCHEDULES`` in
executor/spec.py) run a stage's backward of one micro-batch as an I (its input gradients, which
the previous stage waits for) and a later W (its weight gradients, where the pipeline would
idle). torch's own split (``stage_backward_input`` / ``_weight`` in
torch/distributed/pipelining/_backward.py) works on the autograd graph PipelineStage sees, and
ours does not suit it: a recomputed micro-batch has no graph until its backward (executor/
recompute.py's Checkpoint node recomputes inside its own backward, where torch's split cannot
reach the weights), a segment of recomputed layers is torch's reentrant checkpoint, which
refuses ``autograd.grad(inputs=...)`` (the known failure of activation checkpointing under these
schedules, pytorch#136766 and its kin), and torch 2.11's split sums a node's gradients into its
first output. So under these schedules a WireStage runs its stage as one autograd node of its
own (:func:`split_call`, or the Checkpoint node when it recomputes), whose backward splits
itself, with public autograd API only, the same on torch 2.11 to 2.15: PipelineStage is built
with ``dw_builder`` (:meth:`WeightGrads.builder`), so torch runs each backward of the stage
whole (``autograd.backward``), which our node turns into the I (input gradients now, the
weight part queued), and runs the builder's runner at the W (at once for a FULL_BACKWARD).

The split is torch 2.13's: walk the graph from the outputs, find the nodes where the paths to
the weights leave the paths to the inputs (the "intermediates"), keep the gradients that reach
them while the input gradients are computed (``autograd.grad`` to the inputs, graph retained),
and at the W run ``autograd.grad`` from those nodes to the weights' accumulators. The graph
between the outputs and the intermediates is freed after the I; what the W needs lives until it
runs ([Note: split backward] in autopipe/core/zero_bubble.py). Three cases do not split:

- torch runs a whole backward (FULL_BACKWARD: the B of DualPipeV, and every I that its W
  follows at once, [Note: adjacent I and W] in executor/spec.py): the stage's
  ``backward_one_chunk`` says so (``WeightGrads.whole``) and the backward runs whole;

- no input needs a gradient (the first stage; a cut of integers): the whole backward waits for
  the W, as torch runs its own first stage;
- the graph holds torch's reentrant checkpoint (a segment of recomputed layers): neither half can
  pass through it, so the I runs the whole backward and the W has nothing left.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from executor.recompute import get_phony

__all__ = ["WeightGrads", "split_backward", "split_call", "weight_groups"]

Weights = Callable[[], Iterable[Tensor]]  # the stage's parameters, read when its backward runs


class WeightGrads:
    """One stage's weight-gradient work, queued by the I of each backward and run at its W."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        self._queued: list[Callable[[], None]] = []
        self.whole = False  # set while torch runs a whole backward (B): no split then

    def queue(self, work: Callable[[], None]) -> None:
        self._queued.append(work)

    def clear(self) -> None:
        """Drop what a failed step left (a step starts with nothing queued)."""
        self._queued = []

    def builder(self) -> Callable[[], None]:
        """PipelineStage's ``dw_builder``, called right after a micro-batch's backward: the W
        of what that backward queued."""
        work, self._queued = self._queued, []

        def run() -> None:
            for item in work:
                item()

        return run


def _node(t: Tensor) -> Node | None:
    """``t``'s grad_fn, or the gradient accumulator of a leaf (made if it was not yet)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    with torch.enable_grad():  # backward runs with grad mode off
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _reverse_edges(roots: Sequence[Node]) -> tuple[dict[Node, list[Node]], bool]:
    """Each node's consumers in the graph below ``roots``, and whether it holds a reentrant
    checkpoint."""
    reverse: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    reentrant = False
    while queue:
        node = queue.popleft()
        reentrant = reentrant or node.name().endswith("CheckpointFunctionBackward")
        for child, _ in node.next_functions:
            if child is not None:
                reverse[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
    return reverse, reentrant


def _closure(roots: Iterable[Node], stop: set[Node], reverse: dict[Node, list[Node]]) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``roots`` along ``reverse``, and those of ``stop`` met on the way."""
    closure, met = set(roots), set()
    queue = collections.deque(closure)
    while queue:
        for consumer in reverse.get(queue.popleft(), []):
            if consumer in closure:
                continue
            if consumer in stop:
                met.add(consumer)
                continue
            closure.add(consumer)
            queue.append(consumer)
    return closure, met


def _groups(inputs: list[Node], weights: list[Node], roots: list[Node],
            reverse: dict[Node, list[Node]]) -> list[tuple[set[Node], set[Node]]] | None:
    """The weights grouped by the nodes where their paths meet the input paths (torch's
    ``get_param_groups``): ``(weights, intermediates)``, groups sharing no intermediate; None
    when a weight's path reaches an output without meeting them (an output of the weights
    alone: neither half would give that part of their gradient)."""
    input_side, _ = _closure(inputs, set(), reverse)
    of_node: dict[Node, tuple[set[Node], set[Node]]] = {}
    for weight in weights:
        if weight not in reverse:
            continue  # not used by this graph
        reached, met = _closure([weight], input_side, reverse)
        if any(root in reached for root in roots):
            return None
        group: tuple[set[Node], set[Node]] = ({weight}, set(met))
        for old in {id(of_node[n]): of_node[n] for n in met if n in of_node}.values():
            group[0].update(old[0])
            group[1].update(old[1])
        for node in group[1]:
            of_node[node] = group
    return list({id(g): g for g in of_node.values()}.values())


def weight_groups(roots: list[Node], reverse: dict[Node, list[Node]], inputs: Sequence[Tensor],
                  weights: Iterable[Tensor]) -> tuple[dict[Node, Tensor], list[tuple[set[Node], set[Node]]] | None]:
    """The split's analysis of the graph below ``roots`` (``reverse``: :func:`_reverse_edges`):
    the gradient accumulators of ``weights`` it uses, each with its weight, and their groups
    (:func:`_groups`; None where the split cannot reach a weight)."""
    accumulators = {node: w for w in weights if (node := _node(w)) is not None and node in reverse}
    nodes = [n for n in map(_node, inputs) if n is not None]
    return accumulators, _groups(nodes, list(accumulators), roots, reverse)


def split_backward(outputs: Sequence[Tensor], grads: Sequence[Tensor | None], leaves: Sequence[Tensor],
                   weights: WeightGrads) -> list[Tensor | None]:
    """The gradients of ``leaves`` (the stage's inputs) from ``outputs``' ``grads``; the weight
    gradients' work queued on ``weights`` (see [Note: split backward on ranks])."""
    pairs = [(y, g) for y, g in zip(outputs, grads, strict=True) if y.requires_grad and g is not None]
    none: list[Tensor | None] = [None] * len(leaves)
    if not pairs:
        return none
    ys, gs = [y for y, _ in pairs], [g for _, g in pairs]
    if weights.whole:  # torch's B: both halves now, as one backward ([Note: adjacent I and W])
        torch.autograd.backward(ys, gs)
        return [x.grad if x.requires_grad else None for x in leaves]
    roots = [n for n in map(_node, ys) if n is not None]
    reverse, reentrant = _reverse_edges(roots)
    wanted = [k for k, x in enumerate(leaves) if x.requires_grad]
    if not wanted and not reentrant:  # nothing to send back: the whole backward at the W
        weights.queue(lambda: torch.autograd.backward(ys, gs))
        return none
    accumulators, groups = ({}, None) if reentrant else \
        weight_groups(roots, reverse, [leaves[k] for k in wanted], weights.weights())
    if groups is None:  # a reentrant checkpoint (it refuses autograd.grad), or a weight the split
        torch.autograd.backward(ys, gs)  # cannot reach: the whole backward, now
        return [x.grad if x.requires_grad else None for x in leaves]
    kept: dict[Node, tuple[Tensor | None, ...]] = {}

    def keeper(node: Node) -> Callable[[tuple[Tensor | None, ...]], None]:
        def keep(grad_outputs: tuple[Tensor | None, ...]) -> None:
            kept[node] = grad_outputs
        return keep

    handles = [node.register_prehook(keeper(node)) for _, met in groups for node in met]
    try:
        found = torch.autograd.grad(ys, [leaves[k] for k in wanted], gs, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    # the W holds the intermediates, not the outputs: the graph above them goes with this call
    weights.queue(lambda: _weight_part(groups, kept, accumulators))
    out = list(none)
    for k, g in zip(wanted, found, strict=True):
        out[k] = g
    return out


def _weight_part(groups: list[tuple[set[Node], set[Node]]], kept: dict[Node, tuple[Tensor | None, ...]],
                 accumulators: dict[Node, Tensor]) -> None:
    """The W: each group's weight gradients from what its intermediates kept, added to the
    weights' ``.grad`` (torch 2.13's ``stage_backward_weight``). A group apart from the others,
    so that autograd computes its weights' gradients only, not again the inputs' below; within
    a group whose intermediates lie one below another, what reaches each is replaced by what it
    kept, so it counts once; the graph is kept until the last group, which a group may cross."""
    for k, (params, met) in enumerate(groups):
        edges = [GradientEdge(n, i) for n in met for i, g in enumerate(kept.get(n, ())) if g is not None]
        outputs = [g for n in met for g in kept.get(n, ()) if g is not None]
        if not edges:
            continue
        handles = [n.register_prehook(lambda _, grads=kept[n]: grads) for n in met if n in kept] \
            if len(met) > 1 else []
        try:
            nodes = list(params)
            found = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in nodes], outputs,
                                        retain_graph=k < len(groups) - 1, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for node, g in zip(nodes, found, strict=True):
            if g is None:
                continue
            weight = accumulators[node]
            if weight.grad is None:
                weight.grad = g
            else:
                weight.grad += g
    kept.clear()  # the intermediates and their gradients: freed as the W ends


class _SplitRun:
    """One (stage, micro-batch) run as a single node whose backward splits."""

    def __init__(self, function: Callable[..., tuple[Tensor, ...]], weights: WeightGrads) -> None:
        self.function, self.weights = function, weights
        self.graph: tuple[tuple[Tensor, ...], list[Tensor]] | None = None  # its outputs and leaves


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, run: _SplitRun, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.run = run
        ctx.set_materialize_grads(False)
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            out = run.function(*leaves)
        run.graph = (out, leaves)
        outputs = tuple(t.detach() for t in out)
        ctx.mark_non_differentiable(*[t for t in outputs if not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        run: _SplitRun = ctx.run
        assert run.graph is not None, "a split stage's backward ran twice"
        out, leaves = run.graph
        run.graph = None
        return (None, None, *split_backward(out, grads, leaves, run.weights))


def split_call(function: Callable[..., tuple[Tensor, ...]], inputs: Sequence[Tensor], device: torch.device,
               weights: WeightGrads) -> tuple[Tensor, ...]:
    """``function(*inputs)`` as one autograd node whose backward is split ([Note: split
    backward on ranks]); a phony input that needs a gradient keeps the node in the graph when
    no input does (the first stage)."""
    phony = get_phony(device, requires_grad=True)
    out: tuple[Tensor, ...] = _Split.apply(phony, _SplitRun(function, weights), *inputs)
    return out
