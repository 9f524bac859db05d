"""The tensor-parallel structure of a traced model: which layers Megatron's patterns split.

[Note: tensor-parallel structure] Found on the fx graph's nodes, then said per layer as the
torch-free role, group and divisor of autopipe/core/tensor_parallel.py ([Note: tensor-parallel
cost] there says what each costs at a degree). The patterns (Megatron-LM, Shoeybi et al. 2019):

- A GROUP is one or more column-parallel Linears whose outputs reach one row-parallel Linear
  through parameter-free ops only (the "region": activations, gating, rotary, attention,
  dropout, views). Its split values never leave it: every tensor a column or a region node makes
  is read by the region or the row Linear alone, and every activation the region reads from
  outside is a column's (values that depend on no parameter, a mask, rotary tables, positions,
  are the same on every rank and may enter). Walking back from each Linear in graph order, the
  first Linears reached are its columns; a Linear is a row at most once and never also a column
  (a Linear-ReLU-Linear-ReLU chain pairs as (1, 2), (3, 4)). A region with an attention op
  (scaled_dot_product_attention, or a matmul of two 4-D activations) is ``attention``: the degree
  must divide every column's head count (the head-split view after it: q's heads and the kv
  heads, whose gcd is the divisor); else ``mlp``: it must divide the columns' output features.
- The token embedding (the largest nn.Embedding / aten.embedding) is vocab-parallel, and so is
  the LM head, a Linear tied to it or as wide as the vocabulary that no group holds: the vocab
  group, divisor the vocabulary (a degree that does not divide it leaves both replicated).
- Everything else (norms, residual adds, position embeddings, a classifier) is replicated; of
  it, the nodes between the groups on the tokens' own path (norms, residual adds, dropout) are
  ``sequence`` nodes ([Note: sequence nodes] in autopipe/frontend/tracing/sequence_parallel.py),
  replicated or split by tokens under sequence parallelism. A layer is ``sequence`` when each of
  its non-cheap activation nodes is one and it holds no node of a group or the vocabulary.

A layer takes the role of its non-cheap nodes (grouping.is_cheap); a layer holding nodes of two
roles, or of one and replicated work (a coarse layer: ``leaf_modules=[Block]``, [Note: automatic
granularity]), cannot have its measured time split by role, so the groups in it are dropped and
their layers planned replicated (``dropped`` counts them). A model with no group and no vocabulary
(a CNN) has every layer replicated and plans with tensor_parallel=1 only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autopipe.core.tensor_parallel import (
    COLUMN,
    REPLICATED,
    ROW,
    SEQUENCE,
    SHARDED,
    VOCAB_EMBEDDING,
    VOCAB_GROUP,
    VOCAB_HEAD,
    LayerRole,
)
from autopipe.frontend.tracing.grouping import is_cheap
from autopipe.frontend.tracing.sequence_parallel import sequence_nodes

__all__ = ["find_tensor_parallel", "op_name", "tensor_parallel_nodes", "Structure"]

_LINEAR_OPS = {"linear", "addmm", "mm", "matmul"}
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")
_WALK_LIMIT = 400  # nodes a region may hold: a longer parameter-free run is not one block


@dataclass
class Structure:
    """Per layer its role; how many groups were dropped for sitting in a layer of mixed roles."""

    roles: dict[str, LayerRole]
    dropped: int = 0
    groups: dict[str, int] = field(default_factory=dict)  # group -> divisor
    tokens: frozenset[str] = frozenset()  # the fx nodes whose values split by tokens ([Note: sequence nodes])


def op_name(node: fx.Node) -> str:
    """The op a node calls, by name (``linear`` for ``aten.linear.default``, ``F.linear``)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", ""))
    return str(getattr(target, "__name__", target))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _tensor(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _floating(node: fx.Node) -> bool:
    """Whether the node makes a floating tensor, alone or in a tuple (a split's parts)."""
    val = node.meta.get("val")
    parts = val if isinstance(val, tuple | list) else (val,)
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in parts)


class _Graph:
    """The fx graph's nodes with what the patterns ask of them."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.params: dict[fx.Node, list[nn.Parameter]] = {n: self._params_of(n) for n in self.nodes}
        self.weight: dict[fx.Node, tuple[torch.Tensor, int]] = {}  # linear -> (weight, out features)
        self.embedding: dict[fx.Node, torch.Tensor] = {}
        for n in self.nodes:
            self._classify(n)
        self.carries: set[fx.Node] = set()  # floating activations that depend on a parameter
        for n in self.nodes:
            if n.op in ("get_attr", "placeholder", "output") or not _floating(n):
                continue
            if self.params[n] or any(i in self.carries for i in n.all_input_nodes):
                self.carries.add(n)

    def _params_of(self, n: fx.Node) -> list[nn.Parameter]:
        if n.op == "call_module":
            return list(self.gm.get_submodule(str(n.target)).parameters())
        found = [_attr(self.gm, str(i.target)) for i in n.all_input_nodes if i.op == "get_attr"]
        return [p for p in found if isinstance(p, nn.Parameter)]

    def _classify(self, n: fx.Node) -> None:
        mats = [p for p in self.params[n] if p.dim() == 2]
        if n.op == "call_module":
            mod = self.gm.get_submodule(str(n.target))
            if isinstance(mod, nn.Linear):
                self.weight[n] = (mod.weight, mod.out_features)
            elif type(mod).__name__ == "Conv1D" and isinstance(w := getattr(mod, "weight", None), torch.Tensor):
                self.weight[n] = (w, int(w.shape[1]))  # HF's transposed Linear
            elif isinstance(mod, nn.Embedding):
                self.embedding[n] = mod.weight
            return
        name = op_name(n)
        out = _tensor(n)
        if name == "embedding" and mats:
            self.embedding[n] = mats[0]
        elif name in _LINEAR_OPS and len(mats) == 1 and out is not None and out.dim() >= 1:
            self.weight[n] = (mats[0], int(out.shape[-1]))

    def activation_inputs(self, n: fx.Node) -> list[fx.Node]:
        return [i for i in n.all_input_nodes if i in self.carries]

    def tensor_users(self, n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u.op == "output" or u in self.carries]


@dataclass
class _Group:
    row: fx.Node
    columns: list[fx.Node]
    region: set[fx.Node]
    kind: str
    divisor: int


def _region(g: _Graph, row: fx.Node) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """The columns and the parameter-free region behind ``row``, or None where the walk meets a
    parameter that is not a Linear's (a norm, an embedding) or runs too long."""
    columns: list[fx.Node] = []
    region: set[fx.Node] = set()
    todo = g.activation_inputs(row)
    while todo:
        n = todo.pop()
        if n in region or n in columns:
            continue
        if n in g.weight:
            columns.append(n)
        elif g.params[n] or len(region) >= _WALK_LIMIT:
            return None
        else:
            region.add(n)
            todo.extend(g.activation_inputs(n))
    return (sorted(columns, key=g.order.__getitem__), region) if columns else None


def _is_attention(g: _Graph, n: fx.Node) -> bool:
    name = op_name(n)
    if any(a in name for a in _ATTENTION_OPS):
        return True
    acts = g.activation_inputs(n)
    return name in ("matmul", "bmm", "einsum") and len(acts) >= 2 and all(
        (t := _tensor(a)) is not None and t.dim() == 4 for a in acts)


def _heads(g: _Graph, column: fx.Node, region: set[fx.Node]) -> int | None:
    """The heads of the first 4-D view a column's output takes in the region (its numel over
    the tokens and the head size); for a fused q/k/v, the first part's."""
    out = _tensor(column)
    if out is None or out.dim() < 1 or not out.shape[-1]:
        return None
    tokens = out.numel() // int(out.shape[-1])
    seen, todo = set(), [column]
    while todo:
        n = todo.pop(0)
        for u in sorted(n.users, key=g.order.__getitem__):
            t = _tensor(u)
            if u not in region or u in seen:
                continue
            seen.add(u)
            if t is not None and t.dim() == 4 and tokens and int(t.shape[-1]):
                return int(t.numel()) // (tokens * int(t.shape[-1])) or None
            todo.append(u)
    return None


def _group(g: _Graph, row: fx.Node) -> _Group | None:
    found = _region(g, row)
    if found is None:
        return None
    columns, region = found
    inside = region | {row}
    for n in [*columns, *region]:  # split values never leave the group
        if any(u not in inside for u in g.tensor_users(n)):
            return None
    if any(a not in region and a not in columns for n in region for a in g.activation_inputs(n)):
        return None  # pragma: no cover - the walk adds every activation input of the region
    if any(_is_attention(g, n) for n in region):
        heads = [_heads(g, c, region) for c in columns]
        if any(h is None for h in heads):
            return None
        return _Group(row, columns, region, "attention", math.gcd(*(int(h or 0) for h in heads)))
    return _Group(row, columns, region, "mlp", math.gcd(*(g.weight[c][1] for c in columns)))


def _groups(g: _Graph) -> list[_Group]:
    rows: set[fx.Node] = set()
    columns: set[fx.Node] = set()
    out: list[_Group] = []
    for n in g.nodes:
        if n not in g.weight or n in columns:
            continue
        group = _group(g, n)
        if group is None or any(c in rows or c in columns for c in group.columns):
            continue
        rows.add(n)
        columns.update(group.columns)
        out.append(group)
    return out


def _vocab(g: _Graph, grouped: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node], int]:
    """The token embeddings and LM heads (vocab-parallel) and the vocabulary; none without an
    embedding."""
    if not g.embedding:
        return [], [], 0
    vocab = max(int(w.shape[0]) for w in g.embedding.values())
    tokens = [n for n, w in g.embedding.items() if int(w.shape[0]) == vocab]
    tied = {id(g.embedding[n]) for n in tokens}
    heads = [n for n, (w, out) in g.weight.items() if n not in grouped
             and (id(w) in tied or out == vocab)]
    return tokens, heads, vocab


def _layer_roles(node_layer: dict[str, str], layers: Iterable[str], g: _Graph,
                 node_role: dict[fx.Node, tuple[str, str]]) -> tuple[dict[str, set[tuple[str, str]]], set[str]]:
    """Per layer the (role, group) of its non-cheap nodes; the layers also doing replicated work."""
    found: dict[str, set[tuple[str, str]]] = {name: set() for name in layers}
    busy: set[str] = set()
    for n in g.nodes:
        layer = node_layer.get(n.name)
        if layer is None or n.op in ("get_attr", "placeholder", "output") or is_cheap(n):
            continue
        if n in node_role:
            found[layer].add(node_role[n])
        elif n in g.carries:
            busy.add(layer)
    return found, busy


def _node_roles(g: _Graph, node_layer: dict[str, str]) -> tuple[dict[fx.Node, tuple[str, str]], dict[str, int]]:
    """Each fx node's (role, group) in the groups and the vocabulary found, and their divisors."""
    groups = _groups(g)
    grouped = {n for grp in groups for n in (grp.row, *grp.columns)}
    tokens, heads, vocab = _vocab(g, grouped)
    divisor: dict[str, int] = {}
    node_role: dict[fx.Node, tuple[str, str]] = {}
    for grp in groups:
        name = f"{grp.kind}:{node_layer.get(grp.row.name, grp.row.name)}"
        divisor[name] = grp.divisor
        node_role.update({c: (COLUMN, name) for c in grp.columns})
        node_role.update({r: (SHARDED, name) for r in grp.region})
        node_role[grp.row] = (ROW, name)
    if tokens:
        divisor[VOCAB_GROUP] = vocab
        node_role.update({n: (VOCAB_EMBEDDING, VOCAB_GROUP) for n in tokens})
        node_role.update({n: (VOCAB_HEAD, VOCAB_GROUP) for n in heads})
    return node_role, divisor


def _found(gm: fx.GraphModule, node_layer: dict[str, str],
           layers: list[str]) -> tuple[Structure, dict[fx.Node, tuple[str, str]]]:
    g = _Graph(gm)
    node_role, divisor = _node_roles(g, node_layer)
    found, busy = _layer_roles(node_layer, layers, g, node_role)
    dropped: set[str] = set()
    while True:  # a layer of mixed roles drops its groups, which may mix other layers in turn
        mixed = {grp for name, pairs in found.items() if len(pairs) > 1 or (pairs and name in busy)
                 for _, grp in pairs} - dropped
        if not mixed:
            break
        dropped |= mixed
        for name, pairs in found.items():
            if any(grp in dropped for _, grp in pairs):
                busy.add(name)
            found[name] = {p for p in pairs if p[1] not in dropped}
    kept = {n: pair for n, pair in node_role.items() if pair[1] not in dropped}
    sources = [n for n, (role, _) in kept.items() if role in (ROW, VOCAB_EMBEDDING)]
    tokenwise, split = sequence_nodes(gm, g.nodes, g.carries, set(kept), sources, op_name)
    work = _layer_work(node_layer, g)
    roles = {}
    for name in layers:
        pairs = found[name]
        role, group = next(iter(pairs)) if pairs else (REPLICATED, "")
        if not pairs and work.get(name) and work[name] <= tokenwise:
            role = SEQUENCE
        roles[name] = LayerRole(role, group, divisor.get(group, 0))
    kept.update({n: (SEQUENCE, "") for n in tokenwise})
    return Structure(roles, len(dropped), {k: v for k, v in divisor.items() if k not in dropped},
                     frozenset(n.name for n in split)), kept


def _layer_work(node_layer: dict[str, str], g: _Graph) -> dict[str, set[fx.Node]]:
    """Per layer its non-cheap activation nodes (what its measured time is spent on)."""
    work: dict[str, set[fx.Node]] = {}
    for n in g.nodes:
        layer = node_layer.get(n.name)
        if layer is not None and n in g.carries and not is_cheap(n):
            work.setdefault(layer, set()).add(n)
    return work


def find_tensor_parallel(gm: fx.GraphModule, node_layer: dict[str, str], layers: list[str]) -> Structure:
    """Each layer's role, group and divisor ([Note: tensor-parallel structure])."""
    return _found(gm, node_layer, layers)[0]


def tensor_parallel_nodes(gm: fx.GraphModule, node_layer: dict[str, str],
                          layers: list[str]) -> tuple[Structure, dict[str, tuple[str, str]]]:
    """The structure and, per fx node name, the (role, group) of every node of a group kept (a
    group dropped for a layer of mixed roles runs replicated) and ``(SEQUENCE, "")`` of every
    sequence node ([Note: sequence nodes]): what a runtime shards."""
    structure, kept = _found(gm, node_layer, layers)
    return structure, {n.name: pair for n, pair in kept.items()}
