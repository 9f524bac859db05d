"""A captured graph of a model cut to ``a`` identical blocks, grown to ``n`` of them: the nodes of
its last block copied after each of its runs, with the names, targets, module paths and state
the trace of ``n`` blocks gives ([Note: repeated blocks] in repeated.py).

Every node is labelled with the block it runs in (its target or ``nn_module_stack`` under the
blocks' path; a node the tracer's later passes added, with no stack, takes the block of the
nodes around it). The copies of the last block (``a - 1``) read the shared values the blocks
read (the mask, the rotary tables) as the template does, and what the template reads of the
block before it (``a - 2``, paired node for node) from the copy before. A node name is torch.fx's
``base_N``: each block takes the same count of every base, so a name is linear in the block
copied and in ``n``, and :class:`Names` holds the two slopes, learnt from the traces of ``a``
and ``a + 1`` blocks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from autopipe.frontend.tracing.capture import Capture
from autopipe.frontend.tracing.modes import ModeBinding, by_mode, run_in_mode

__all__ = ["Growth", "Names", "grow"]

# torch.fx's own rule for a node name: a base, then an optional _N (torch/fx/graph.py, _name_regex)
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


class NotRepeated(Exception):
    """Why a graph cannot be grown (the full trace runs instead)."""


def _split(name: str) -> tuple[str, int]:
    match = _NAME.match(name)
    if match is None:
        raise NotRepeated(f"node name {name!r} is not torch.fx's base_N")
    return match.group(1), int(match.group(2) or 0)


def _render(base: str, num: int) -> str:
    return base if num == 0 else f"{base}_{num}"


@dataclass(frozen=True)
class Reindex:
    """Block ``old`` of ``path`` renamed block ``new``, in dotted paths and in node names."""

    path: str  # "model.layers"

    def dotted(self, text: str, old: int, new: int) -> str:
        return _pattern(rf"(?<![0-9a-zA-Z.]){re.escape(self.path)}\.{old}(?=\.|$)").sub(f"{self.path}.{new}", text)

    def named(self, text: str, old: int, new: int) -> str:
        flat = self.path.replace(".", "_")
        return _pattern(rf"(?<![0-9a-zA-Z]){re.escape(flat)}_{old}(?=_|$)").sub(f"{flat}_{new}", text)

    def block_of(self, text: str) -> int | None:
        match = _pattern(rf"{re.escape(self.path)}\.(\d+)(?:\.|$)").match(text)
        return int(match.group(1)) if match else None


@functools.lru_cache(maxsize=64)
def _pattern(source: str) -> re.Pattern[str]:
    return re.compile(source)


def _stack_path(entry: Any) -> str:
    path = entry[0] if isinstance(entry, tuple) else entry
    return str(path).replace("L['self'].", "").replace("L__self___", "")


def _labels(gm: fx.GraphModule, where: Reindex) -> dict[fx.Node, int | None]:
    """Each node's block, or None outside every block."""
    known: dict[fx.Node, int | None] = {}
    unknown: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            known[node] = where.block_of(str(node.target))
        elif node.op in ("placeholder", "output"):
            known[node] = None
        elif "nn_module_stack" in node.meta:
            paths = [_stack_path(v) for v in (node.meta["nn_module_stack"] or {}).values()]
            known[node] = next((b for b in map(where.block_of, paths) if b is not None), None)
        else:
            unknown.append(node)
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    for node in unknown:  # a node a pass added (by_mode, a check): the block of the nodes around it
        before = next((known[m] for m in reversed(nodes[:at[node]]) if m in known and m.op != "get_attr"), None)
        after = next((known[m] for m in nodes[at[node] + 1:] if m in known and m.op != "get_attr"), None)
        known[node] = before if before == after else None
    return known


@dataclass
class Growth:
    """The graph of ``a`` blocks and how it grows: its labels, the last block's runs, the block
    before it paired node for node."""

    cap: Capture
    a: int
    where: Reindex
    label: dict[fx.Node, int | None] = field(default_factory=dict)
    twin: dict[fx.Node, fx.Node] = field(default_factory=dict)  # block a-2's node -> block a-1's
    nodes: list[fx.Node] = field(default_factory=list)  # the graph's, as captured

    def __post_init__(self) -> None:
        self.nodes = list(self.cap.gm.graph.nodes)
        self.label = _labels(self.cap.gm, self.where)
        last, before = self.a - 1, self.a - 2
        template = [n for n in self.nodes if self.label[n] == last]
        previous = [n for n in self.nodes if self.label[n] == before]
        if not template:
            raise NotRepeated(f"no node runs in {self.where.path}.{last}")
        if len(template) != len(previous):
            raise NotRepeated(f"{self.where.path}.{before} and .{last} trace to {len(previous)} and "
                              f"{len(template)} nodes")
        for p, t in zip(previous, template, strict=True):
            if p.op != t.op or _target(self.where, p, before, last) != t.target:
                raise NotRepeated(f"{self.where.path}.{before} and .{last} differ at {p.name} / {t.name}")
        self.twin = dict(zip(previous, template, strict=True))

    def order(self, n: int) -> Iterator[tuple[fx.Node, int]]:
        """(node of this graph, copy) in the grown graph's order: copy 0 is the node itself,
        copy j of a last-block node runs in block ``a - 1 + j``."""
        nodes = self.nodes
        last = self.a - 1
        run: list[fx.Node] = []
        for i, node in enumerate(nodes):
            yield node, 0
            if self.label[node] != last:
                continue
            run.append(node)
            if i + 1 == len(nodes) or self.label[nodes[i + 1]] != last:
                for j in range(1, n - self.a + 1):
                    for member in run:
                        yield member, j
                run = []


def _target(where: Reindex, node: fx.Node, old: int, new: int) -> Any:
    if node.op in ("get_attr", "call_module"):
        return where.dotted(str(node.target), old, new)
    return node.target


@dataclass
class Names:
    """Each node's name in a graph of ``n`` blocks: ``base_(N + (n - a) * shift + j * step)`` for
    copy ``j``, or (a name holding its block, ``model_layers_3_mlp_weight``) that name's block
    renumbered."""

    shift: dict[fx.Node, int] = field(default_factory=dict)
    step: dict[fx.Node, int] = field(default_factory=dict)
    indexed: set[fx.Node] = field(default_factory=set)

    @classmethod
    def learn(cls, growth: Growth, bigger: Capture) -> Names:
        """The slopes from the trace of ``a + 1`` blocks, whose nodes line up with the grown
        order; a block's step checked against the step between the template's blocks."""
        out = cls()
        order = list(growth.order(growth.a + 1))
        names = [n.name for n in bigger.gm.graph.nodes]
        if len(order) != len(names):
            raise NotRepeated(f"{growth.a + 1} blocks trace to {len(names)} nodes, {growth.a} grown to "
                              f"{len(order)}")
        image = {node: name for (node, j), name in zip(order, names, strict=True) if j == 0}
        last = growth.a - 1
        back = {t: p for p, t in growth.twin.items()}
        for (node, j), name in zip(order, names, strict=True):
            if j == 0:
                base, num = _split(node.name)
                big_base, big_num = _split(name)
                if base != big_base:
                    raise NotRepeated(f"{node.name} is {name} with one more block")
                out.shift[node] = big_num - num
                continue
            if growth.where.named(node.name, last, last + 1) == name != node.name and image[node] == node.name:
                out.indexed.add(node)
                continue
            base, _ = _split(node.name)
            copy_base, copy_num = _split(name)
            _, image_num = _split(image[node])
            step = copy_num - image_num
            _, own = _split(node.name)
            _, earlier = _split(back[node].name)
            if copy_base != base or step != own - earlier:
                raise NotRepeated(f"{node.name}'s copy is named {name}, not one block's step on from it")
            out.step[node] = step
        return out

    def name(self, growth: Growth, node: fx.Node, j: int, n: int) -> str:
        last = growth.a - 1
        if j and node in self.indexed:
            return growth.where.named(node.name, last, last + j)
        base, num = _split(node.name)
        return _render(base, num + (n - growth.a) * self.shift[node] + j * self.step.get(node, 0))


def _meta(growth: Growth, node: fx.Node, j: int) -> dict[str, Any]:
    meta = dict(node.meta)
    if j and "nn_module_stack" in meta:
        last, where = growth.a - 1, growth.where
        meta["nn_module_stack"] = {
            where.dotted(str(k), last, last + j): tuple(where.dotted(str(x), last, last + j) if i == 0 else x
                                                        for i, x in enumerate(v)) if isinstance(v, tuple) else v
            for k, v in meta["nn_module_stack"].items()}
    return meta


def _install(template: nn.Module, source: nn.Module, own: nn.Module) -> nn.Module:
    """Block ``own``'s state under the graph module the way ``template`` (the graph module's
    subtree of the block ``source``) holds ``source``'s: the model's own tensors and modules."""
    if template is source:
        return own
    if type(template) is not nn.Module:
        raise NotRepeated(f"the graph holds a block's {type(template).__name__}, not the model's")
    out = nn.Module()
    for name in template._parameters:
        out.register_parameter(name, own._parameters[name])
    for name in template._buffers:
        out.register_buffer(name, own._buffers[name], persistent=name not in template._non_persistent_buffers_set)
    for name, child in template._modules.items():
        if child is None:
            raise NotRepeated("a block holds a module slot set to None")
        out.add_module(name, _install(child, source._modules[name], own._modules[name]))  # type: ignore[arg-type]
    return out


def grow(growth: Growth, n: int, names: Names, model: nn.Module) -> Capture:
    """The capture of ``n`` blocks, grown from ``growth``'s ``a`` ([Note: repeated blocks])."""
    cap, a, where = growth.cap, growth.a, growth.where
    last = a - 1
    graph = fx.Graph(tracer_cls=cap.gm.graph._tracer_cls)
    graph._codegen = cap.gm.graph._codegen
    image: dict[fx.Node, fx.Node] = {}
    copies: dict[int, dict[fx.Node, fx.Node]] = {j: {} for j in range(1, n - a + 1)}

    def final(x: fx.Node) -> fx.Node:  # what a node after the blocks reads of the last block
        return copies[n - a][x] if growth.label[x] == last and n > a else image[x]

    def in_copy(j: int) -> Callable[[fx.Node], fx.Node]:
        def read(x: fx.Node) -> fx.Node:
            block = growth.label[x]
            if block == last:
                return copies[j][x]
            if block == last - 1:
                return image[growth.twin[x]] if j == 1 else copies[j - 1][growth.twin[x]]
            if block is None:
                return image[x]
            raise NotRepeated(f"{x.name} of block {block} is read two blocks on")
        return read

    for node, j in growth.order(n):
        read = (image.__getitem__ if growth.label[node] == last else final) if j == 0 else in_copy(j)
        want = names.name(growth, node, j, n)
        made = graph.create_node(node.op, _target(where, node, last, last + j) if j else node.target,
                                 fx.map_arg(node.args, read), fx.map_arg(node.kwargs, read), name=want,
                                 type_expr=node.type)
        if made.name != want:
            raise NotRepeated(f"the grown graph names {want} {made.name}")
        made.meta = _meta(growth, node, j)
        (copies[j] if j else image)[node] = made
    gm = cap.gm
    holder = gm.get_submodule(where.path) if _has(gm, where.path) else None
    if holder is not None:
        template = holder._modules[str(last)]
        blocks = model.get_submodule(where.path)
        for i in range(a, n):
            holder.add_module(str(i), _install(template, blocks._modules[str(last)],  # type: ignore[arg-type]
                                               blocks._modules[str(i)]))  # type: ignore[arg-type]
    gm.graph = graph
    keys = {made.name: (where.dotted(key, last, last + j) if j and key else key)
            for (node, j), made in zip(growth.order(n), graph.nodes, strict=True)
            for key in [cap.module_key.get(node.name)]}
    modules = dict(model.named_modules())
    types = {k: type(modules[k]).__name__ for k in set(keys.values()) if k and k in modules}
    selected = sum(1 for x in graph.nodes if x.op == "call_function" and x.target is by_mode)
    guarded = sum(1 for x in graph.nodes if x.op == "call_function" and x.target is run_in_mode)
    modes = ModeBinding(selected=selected, guarded=guarded, one_mode=cap.modes.one_mode)
    return Capture(gm=gm, source=cap.source, module_key=keys, module_type=types, kwargs=cap.kwargs,
                   keywords=cap.keywords, modes=modes)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
