"""Keyword inputs of a traced model: batched tensors become graph inputs, the rest constants.

``trace(model, example_inputs, example_kwargs={...})`` ([Note: keyword inputs are positional
inside] in executor/keywords.py): every tensor of ``example_kwargs`` with a batch dimension
(dim >= 1) becomes a placeholder of the graph right after the positional inputs, in the order
of the model's ``forward`` signature, so that the graph's first ``num_args`` placeholders are the
values stage 0 takes and a pipeline splits into micro-batches. ``None``, non-tensors and 0-dim
tensors stay constants, as ``kwargs=`` are. torch.export keeps its keyword inputs in the order
given (so they are passed batched first); torch.fx makes every non-constant parameter a
placeholder in signature order, so its placeholders are moved into that order after tracing.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from autopipe.errors import TraceError
from executor._torch_compat import tree_leaves

__all__ = ["split_keywords", "order_placeholders", "export_dynamic_by_name", "KeywordCall"]


def _is_input(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def split_keywords(model: nn.Module, example_kwargs: Mapping[str, Any] | None,
                   kwargs: Mapping[str, Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(keyword inputs in signature order, constants): ``example_kwargs``' batched tensors, and
    its other values with ``kwargs``."""
    given = dict(example_kwargs or {})
    constants = dict(kwargs or {})
    both = sorted(set(given) & set(constants))
    if both:
        raise TraceError(f"{both[0]!r} is in both example_kwargs and kwargs: pass it once "
                         "(example_kwargs for a batched input, kwargs for a constant)")
    for key, value in given.items():
        if not isinstance(value, torch.Tensor) and any(_is_input(x) for x in tree_leaves(value)):
            raise TraceError(f"example_kwargs[{key!r}] holds batched tensors inside a "
                             f"{type(value).__name__}: pass each tensor as a keyword of its own")
    order = {name: i for i, name in enumerate(inspect.signature(model.forward).parameters)}
    names = sorted((k for k, v in given.items() if _is_input(v)), key=lambda k: order.get(k, len(order)))
    constants.update({k: v for k, v in given.items() if not _is_input(v)})
    return {k: given[k] for k in names}, constants


def order_placeholders(gm: fx.GraphModule, positional: int, keywords: tuple[str, ...]) -> None:
    """Move a torch.fx graph's keyword-input placeholders right after its positional ones."""
    if not keywords:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {str(n.target): n for n in placeholders[positional:]}
    missing = [k for k in keywords if k not in by_name]
    if missing:  # a keyword the forward takes through **kwargs: torch.fx cannot make it an input
        raise TraceError(f"keyword input {missing[0]!r} is not a parameter of the traced forward")
    wanted = placeholders[:positional] + [by_name[k] for k in keywords]
    wanted += [n for n in placeholders if n not in wanted]
    anchor = wanted[0]
    for node in wanted[1:]:
        anchor.append(node)
        anchor = node
    gm.recompile()


def export_dynamic_by_name(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """torch.export's dynamic_shapes by parameter name: ``Dim.AUTO`` for every dimension of size
    >= 2 of every tensor ([Note: dynamic sizes] in shapes.py), None for other values."""
    auto = torch.export.Dim.AUTO

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: auto for d, n in enumerate(value.shape) if n >= 2}
        return None

    signature = inspect.signature(model.forward)
    bound = signature.bind(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(spec(v) for v in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: spec(v) for k, v in value.items()}
        else:
            out[name] = spec(value)
    return out


class KeywordCall(nn.Module):
    """``model`` called with the graph's input order: ``positional`` values, then the batched
    keyword inputs ``names`` (split_keywords' order), with ``constants`` as keywords. What a
    step that runs the whole model on the graph's inputs (the loss's timing, a rank's twin)
    calls; its parameters are ``model``'s own."""

    def __init__(self, model: nn.Module, positional: int, names: tuple[str, ...],
                 constants: Mapping[str, Any]) -> None:
        super().__init__()
        self.model, self.positional, self.names, self.constants = model, positional, names, dict(constants)

    def forward(self, *inputs: Any) -> Any:
        keywords = dict(zip(self.names, inputs[self.positional:], strict=True))
        return self.model(*inputs[:self.positional], **keywords, **self.constants)
