"""A model of many identical blocks traced on two and three of them, the rest repeated.

[Note: repeated blocks] torch.export costs about a second per decoder block of a Llama on these
CPUs whatever its width (most of it reasoning about symbolic sizes), so the 80 blocks of a
Llama-70B shape took 65-90 s to trace and the 126 of the 405B shape 105-170 s, where
``profile(estimate=)`` then counts every layer in about five. With ``trace(..., repeated=True)``
(what ``profile(estimate=)`` traces with) a model whose longest stack of blocks (an
``nn.ModuleList`` or ``nn.Sequential`` of at least ``MIN_BLOCKS``, children named 0..N-1) holds
blocks equal in structure (:func:`find_blocks`: each submodule's type, settings, parameter and
buffer shapes, plain attributes, or an int that counts with the block, ``layer_idx``) is traced
twice, cut to its first two blocks and to its first three (capture.py unchanged, both modes
included), and the two-block graph grown to N blocks (repeated_graph.py). Before it is used,
the two-block graph grown to three must be the three-block trace exactly (:func:`same_capture`:
the generated code, so every node's name, op, target and arguments; each node's value, module
stack and source line; the layer each node belongs to; the graph module's parameters and
buffers, the model's own objects). What that cannot see, and what the full trace alone would:
a forward that branches on a block's index beyond what the blocks' attributes show (block 40
runs other ops than block 2 while every block's attributes are equal). So ``trace()`` keeps the
full trace unless asked; anything else (no such stack, a failure, any difference) falls back
to it, and tests/frontend/tracing/test_repeated.py checks the grown graph equal to the full
trace's on HF Llama, GPT-2 and a torch.fx model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopipe.frontend.tracing.capture import Capture
from autopipe.frontend.tracing.repeated_graph import Growth, Names, NotRepeated, Reindex, grow

__all__ = ["MIN_BLOCKS", "Blocks", "find_blocks", "capture_repeated", "same_capture"]

MIN_BLOCKS = 6  # fewer: the two traces of 2 and 3 blocks cost about what the full one does
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class Blocks:
    """The model's stack of identical blocks: its path and how many."""

    path: str
    count: int


def _settings(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, _SCALARS) or isinstance(y, _SCALARS):
        return type(x) is type(y) and x == y
    if isinstance(x, tuple | list) and isinstance(y, tuple | list):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same_value, x, y))
    return x is y  # a config, a function: the same object in every block


def _shape(module: nn.Module) -> list[Any]:
    """What two blocks must share for one to stand for the other (their settings apart)."""
    out: list[Any] = []
    for name, sub in module.named_modules(remove_duplicate=False):
        out.append((name, type(sub), sub.extra_repr(), sorted(_settings(sub)),
                    [(k, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad))
                     for k, p in sub._parameters.items()],
                    [(k, None if b is None else (tuple(b.shape), b.dtype), k in sub._non_persistent_buffers_set)
                     for k, b in sub._buffers.items()],
                    bool(sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                         or sub._backward_pre_hooks or "forward" in vars(sub))))
    return out


def _equal_blocks(blocks: list[nn.Module]) -> bool:
    """Same structure, and every setting equal in all blocks or an int counting with them."""
    if any(_shape(b) != _shape(blocks[0]) for b in blocks[1:]):
        return False
    subs = [dict(b.named_modules(remove_duplicate=False)) for b in blocks]
    for name in subs[0]:
        settings = [_settings(s[name]) for s in subs]
        for key, first in settings[0].items():
            values = [s[key] for s in settings]
            if all(_same_value(first, v) for v in values):
                continue
            if all(type(v) is int for v in values) and len({v - i for i, v in enumerate(values)}) == 1:
                continue  # layer_idx
            return False
    return True


def find_blocks(model: nn.Module, minimum: int = MIN_BLOCKS) -> Blocks | None:
    """The outermost ``nn.ModuleList`` / ``nn.Sequential`` of at least ``minimum`` blocks,
    children named 0..N-1, equal in structure ([Note: repeated blocks]); None if there is none."""
    for path, module in sorted(model.named_modules(), key=lambda item: item[0].count(".")):
        if not path or type(module) not in (nn.ModuleList, nn.Sequential) or len(module._modules) < minimum:
            continue
        children = list(module._modules.values())
        if list(module._modules) != [str(i) for i in range(len(children))] or any(c is None for c in children):
            continue
        if module._forward_hooks or module._forward_pre_hooks:
            continue
        if _equal_blocks(children):  # type: ignore[arg-type]
            return Blocks(path, len(children))
    return None


@contextlib.contextmanager
def _cut_to(model: nn.Module, blocks: Blocks, k: int) -> Iterator[None]:
    """The model with its first ``k`` blocks only, restored after."""
    parent_path, _, name = blocks.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = parent.get_submodule(name)
    kept = [m for m in full._modules.values() if m is not None][:k]
    parent._modules[name] = nn.ModuleList(kept) if type(full) is nn.ModuleList else nn.Sequential(*kept)
    try:
        yield
    finally:
        parent._modules[name] = full


def capture_repeated(model: nn.Module, capture: Callable[[], Capture],
                     minimum: int = MIN_BLOCKS) -> Capture | str:
    """``capture()`` of ``model`` from its traces cut to 2 and 3 blocks ([Note: repeated
    blocks]), or why it cannot be (the caller then captures the whole model)."""
    blocks = find_blocks(model, minimum)
    if blocks is None:
        return f"no stack of {minimum} or more identical blocks"
    try:
        with _cut_to(model, blocks, 2):
            two = capture()
        with _cut_to(model, blocks, 3):
            three = capture()
        where = Reindex(blocks.path)
        growth = Growth(two, 2, where)
        names = Names.learn(growth, three)
        difference = same_capture(grow(growth, 3, names, model), three)
        if difference:
            return f"{blocks.path} grown from 2 blocks to 3 is not their trace: {difference}"
        return grow(growth, blocks.count, names, model)
    except NotRepeated as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - a model cut short may fail anywhere: the full trace says why
        return f"{type(err).__name__}: {err}"


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device, value.requires_grad, value.stride())
    if isinstance(value, list | tuple):
        return type(value).__name__, tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    return repr(value)


def _state(gm: fx.GraphModule) -> list[Any]:
    return [[(k, id(v)) for k, v in gm.named_parameters(remove_duplicate=False)],
            [(k, id(v)) for k, v in gm.named_buffers(remove_duplicate=False)], list(gm.state_dict())]


def same_capture(x: Capture, y: Capture) -> str:
    """The first difference between two captures that anything downstream reads, "" if none."""
    if x.gm.code != y.gm.code:
        return "the graphs' code differs"
    for a, b in zip(x.gm.graph.nodes, y.gm.graph.nodes, strict=True):
        for key in ("val", "nn_module_stack", "stack_trace"):
            if _describe(a.meta.get(key)) != _describe(b.meta.get(key)):
                return f"node {a.name}'s {key}"
        if a.op == "get_attr" and _attr(x.gm, str(a.target)) is not _attr(y.gm, str(b.target)):
            return f"node {a.name}'s attribute {a.target}"
    if x.module_key != y.module_key or x.module_type != y.module_type:
        return "the nodes' modules"
    if _state(x.gm) != _state(y.gm):
        return "the graph modules' parameters and buffers"
    if (x.source, x.keywords, x.modes) != (y.source, y.keywords, y.modes) or x.kwargs.keys() != y.kwargs.keys():
        return "source, keywords or modes"
    return ""


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
