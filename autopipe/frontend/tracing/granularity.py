"""Layers far finer than the model's modules, grouped back to module boundaries.

[Note: automatic granularity] A traced layer is a leaf-module call or one tensor op
(grouping.py). A forward written as many small ops inside one module (a selective scan
unrolled over time steps: HF Mamba's mixer traces to about a hundred layers per block at 16
tokens) makes hundreds of sub-millisecond layers that no planner gains from, and each is
profiled alone. So, unless the caller chose the granularity (``leaf_modules=`` or
``max_depth=``), :func:`coarsen` merges consecutive layers:

1. Module boundaries first, innermost module first: one call of a module that makes more than
   ``MAX_LAYERS_PER_MODULE`` layers of its own ops and child calls, each child call one layer
   (a block of leaf modules and ops), becomes one layer (named by the module, kind
   ``module``). Its parent is counted after, with it as one layer. A container of blocks
   (a child call of several layers) keeps its blocks.
2. What remains: a run of more than ``MAX_LAYERS_PER_MODULE`` consecutive op layers directly in
   one module's forward (or the model's own) is cut into runs of ``MAX_LAYERS_PER_MODULE``,
   each one layer named by its first (kind ``op``, type ``ops``).

A merged layer is the union of consecutive intervals, so it is an interval too ([Note: layers
are intervals] in graph.py): the fx graph, and so every stage's gradients and recomputation,
are untouched; only which nodes a layer name covers changes. What was merged is returned as
``{merged layer: how many traced layers it holds}`` (``LayerGraph.grouped``, a profile's
``meta["grouped"]``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import networkx as nx
from torch import fx, nn

from autopipe.frontend.tracing.capture import Capture
from autopipe.frontend.tracing.grouping import is_cheap

__all__ = ["MAX_LAYERS_PER_MODULE", "coarsen", "grouped_meta", "mark_grouped"]

MAX_LAYERS_PER_MODULE = 32

Layers = list[tuple[str, list[str]]]


class _Layer:
    def __init__(self, name: str, nodes: list[str], scope: tuple[str, ...], count: int = 1) -> None:
        self.name, self.nodes, self.scope, self.count = name, nodes, scope, count


def _path(entry: object) -> str:
    """A module path of a node's ``nn_module_stack`` entry, as both tracers write it."""
    path = entry[0] if isinstance(entry, tuple) else entry
    return str(path).replace("L['self'].", "").replace("L__self___", "")


def _scope(nodes: Sequence[fx.Node]) -> tuple[str, ...]:
    """The module paths (outermost first) the layer's first real op runs inside."""
    body = [n for n in nodes if n.op != "get_attr"]
    first = next((n for n in body if not is_cheap(n)), body[0] if body else None)
    stack = first.meta.get("nn_module_stack") if first is not None else None
    return tuple(p for p in (_path(v) for v in (stack or {}).values()) if p)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Maximal ranges ``[start, stop)`` of consecutive indices."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _merge(layers: list[_Layer], start: int, stop: int, name: str, scope: tuple[str, ...]) -> list[_Layer]:
    merged = _Layer(name, [n for layer in layers[start:stop] for n in layer.nodes], scope,
                    sum(layer.count for layer in layers[start:stop]))
    return [*layers[:start], merged, *layers[stop:]]


def _unique(name: str, taken: set[str]) -> str:
    out, k = name, 0
    while out in taken:
        k += 1
        out = f"{name}#{k}"
    taken.add(out)
    return out


def coarsen(cap: Capture, layers: Layers, node_layer: dict[str, str]) -> tuple[Layers, dict[str, str], dict[str, int]]:
    """[Note: automatic granularity]: the layers, node -> layer, and what was merged."""
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    current = [_Layer(name, nodes, _scope([by_name[n] for n in nodes])) for name, nodes in layers]
    taken = {name for name, _ in layers}
    sizes = Counter(layer.scope[:d] for layer in current for d in range(1, len(layer.scope) + 1))
    kept: set[str] = set()
    for path in sorted(sizes, key=len, reverse=True):  # innermost first
        if sizes[path] <= MAX_LAYERS_PER_MODULE:
            continue  # no call of it holds more layers than this (merging only lowers it): none is fine
        inside = [i for i, layer in enumerate(current) if layer.scope[:len(path)] == path]
        for start, stop in reversed(_runs(inside)):  # from the back: earlier indices stay valid
            if _is_fine(current[start:stop], len(path)):
                name = _unique(path[-1], taken - {current[i].name for i in range(start, stop)})
                current = _merge(current, start, stop, name, path)
                kept.add(name)
    out: list[_Layer] = []
    run: list[_Layer] = []
    for layer in [*current, None]:
        same = layer is not None and layer.name not in kept and layer.count == 1 and bool(run) \
            and layer.scope == run[0].scope and _is_op(cap, layer)
        if same and layer is not None:
            run.append(layer)
            continue
        out.extend(_cut(run))
        run = [layer] if layer is not None and layer.name not in kept and _is_op(cap, layer) else []
        if layer is not None and not run:
            out.append(layer)
    grouped = {layer.name: layer.count for layer in out if layer.count > 1}
    if not grouped:
        return layers, node_layer, {}
    mapping = {n: layer.name for layer in out for n in layer.nodes}
    return [(layer.name, layer.nodes) for layer in out], {n: mapping.get(n, v) for n, v in node_layer.items()}, grouped


def _is_fine(call: list[_Layer], depth: int) -> bool:
    """One call of a module: more than the limit of layers of its own and child calls, and each
    child call one layer (a block of leaves; a container of blocks keeps its blocks)."""
    items, longest, previous, length = 0, 0, None, 0
    for layer in call:
        child = layer.scope[depth] if len(layer.scope) > depth else None
        if child is not None and child == previous:
            length += 1
        else:
            items, length = items + 1, 1
        longest = max(longest, length if child is not None else 0)
        previous = child
    return items > MAX_LAYERS_PER_MODULE and longest == 1


def _is_op(cap: Capture, layer: _Layer) -> bool:
    return not any(cap.module_key.get(n) for n in layer.nodes)


def _cut(run: list[_Layer]) -> list[_Layer]:
    """A run of op layers in one scope: longer than the limit, cut into runs of the limit."""
    if len(run) <= MAX_LAYERS_PER_MODULE:
        return run
    out = []
    for start in range(0, len(run), MAX_LAYERS_PER_MODULE):
        part = run[start:start + MAX_LAYERS_PER_MODULE]
        out.append(_merge(part, 0, len(part), part[0].name, part[0].scope)[0])
    return out


def mark_grouped(graph: nx.DiGraph, model: nn.Module, grouped: dict[str, int]) -> None:
    """A merged module's layer is of kind ``module`` and that module's type; a merged run of ops
    is of type ``ops``."""
    modules = dict(model.named_modules())
    for name in grouped:
        attrs = graph.nodes[name]
        module = modules.get(name.split("#")[0])
        if module is not None:
            attrs["kind"], attrs["module_type"] = "module", type(module).__name__
        else:
            attrs["kind"], attrs["module_type"] = "op", "ops"


def grouped_meta(layers: Sequence[str], grouped: dict[str, int]) -> dict[str, object]:
    """A profile's ``meta["grouped"]``: how many layers were traced, and each merged layer with
    how many of them it holds."""
    return {"traced_layers": len(layers) - len(grouped) + sum(grouped.values()), "merged": dict(grouped)}
