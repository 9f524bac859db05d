"""The loss a traced model computes itself, and how to count the items it averages over.

A model that computes its own loss (a HuggingFace model called with ``labels=``) returns the
mean of a ``cross_entropy`` or ``nll_loss`` over the target items that are not its
``ignore_index``; a pipeline weights each micro-batch's loss by its share of those items
([Note: a loss the model computes] in executor/model_loss.py). Which items count is found in the
graph, not per model family: the output leaf that is such a mean-reduced loss node (torch.fx's
``F.cross_entropy`` / ``nn.CrossEntropyLoss`` or torch.export's ``aten.cross_entropy_loss``,
``aten.nll_loss*``), and the part of the graph that computes its target from the graph's inputs
(a causal LM's label shift included) cut out as a small GraphModule that returns
``(target != ignore_index).sum()``. A loss with class weights, another reduction, or a target
computed by the model's layers is not counted: a pipeline then weights it by rows like any
other 0-dim output, and says so in one warning when it is built (:func:`uncounted_loss` says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.operator_schemas import normalize_function

from autopipe.frontend.tracing.fx_cut import GraphCut
from executor._torch_compat import tree_leaves

__all__ = ["CountedLoss", "counted_loss", "uncounted_loss"]

_ATEN = torch.ops.aten
_LOSS_FUNCTIONS: set[Any] = {F.cross_entropy, F.nll_loss, _ATEN.cross_entropy_loss.default,
                             _ATEN.nll_loss.default, _ATEN.nll_loss_nd.default,
                             _ATEN.nll_loss2d.default}
_LOSS_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)
_PASS_THROUGH: set[Any] = {_ATEN.alias.default, _ATEN.clone.default, _ATEN.view.default,
                           _ATEN.reshape.default, _ATEN.to.dtype, _ATEN._to_copy.default}
_MEAN = ("mean", 1)  # a reduction by name (torch.nn.functional) or by enum (ATen)
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@dataclass
class CountedLoss:
    """Output leaf ``leaf`` is a mean over the items ``count(*graph inputs)`` returns."""

    leaf: int
    ignore_index: int
    count: fx.GraphModule


def _loss_arguments(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, int, Any, Any] | None:
    """(target node, ignore_index, reduction, class weight) of a loss node; None for others."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, _LOSS_MODULES):
            return None
        target = node.args[1] if len(node.args) > 1 else node.kwargs.get("target")
        return target, int(module.ignore_index), module.reduction, module.weight
    if node.op != "call_function" or node.target not in _LOSS_FUNCTIONS:
        return None
    found = normalize_function(node.target, node.args, dict(node.kwargs),  # type: ignore[arg-type]
                               normalize_to_only_use_kwargs=True)
    if found is None:
        return None
    kw = found.kwargs
    return kw.get("target"), int(kw.get("ignore_index", -100)), kw.get("reduction", "mean"), \
        kw.get("weight")


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for up in todo.pop().all_input_nodes:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def _counter(gm: fx.GraphModule, target: fx.Node, ignore_index: int, inputs: int) -> fx.GraphModule | None:
    """``(target != ignore_index).sum()`` from the graph's first ``inputs`` placeholders."""
    needed = _ancestors(target) | {target}
    if any(n.op == "call_module" for n in needed):
        return None  # the target comes out of the model's layers: not a count of its inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {n.name: n.meta.get("val") for n in placeholders[inputs:]}
    cut = GraphCut(placeholders[:inputs], constants=constants)
    cut.copy(n for n in gm.graph.nodes if n in needed and n.op not in ("placeholder", "get_attr"))
    value = cut.lookup(target)
    counted = cut.graph.call_function(torch.ne, (value, ignore_index))
    cut.graph.output(cut.graph.call_function(torch.sum, (counted,)))
    cut.graph.lint()
    return fx.GraphModule(gm, cut.graph, class_name="CountedItems")


def _losses(gm: fx.GraphModule) -> Iterator[tuple[int, fx.Node, tuple[Any, int, Any, Any]]]:
    """(output leaf, loss node, its arguments) for each output leaf that is such a loss."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for k, leaf in enumerate(tree_leaves(out.args[0])):
        node = leaf
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
            node = node.args[0]
        found = _loss_arguments(gm, node) if isinstance(node, fx.Node) else None
        if found is not None:
            yield k, node, found


def counted_loss(gm: fx.GraphModule, inputs: int) -> CountedLoss | None:
    """The first output leaf that is a mean cross-entropy / NLL loss with a countable target."""
    for k, _node, (target, ignore_index, reduction, weight) in _losses(gm):
        if reduction not in _MEAN or weight is not None or not isinstance(target, fx.Node):
            continue
        count = _counter(gm, target, ignore_index, inputs)
        if count is not None:
            return CountedLoss(leaf=k, ignore_index=ignore_index, count=count)
    return None


def uncounted_loss(gm: fx.GraphModule, inputs: int) -> str:
    """Why the first 0-dim cross-entropy / NLL output is not counted ("" when none is), in words."""
    for k, node, (target, ignore_index, reduction, weight) in _losses(gm):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            continue
        if weight is not None:
            why = "has class weights (weight=)"
        elif reduction not in _MEAN:
            why = f"has reduction={_REDUCTIONS.get(reduction, reduction)!r}"
        elif not isinstance(target, fx.Node) or _counter(gm, target, ignore_index, inputs) is None:
            why = "has a target its layers compute, not one of its inputs"
        else:
            continue
        return f"loss (output leaf {k}) {why}"
    return ""
