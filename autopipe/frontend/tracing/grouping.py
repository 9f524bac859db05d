"""Group a captured GraphModule's nodes into layers, and describe each layer.

See [Note: layers are intervals] in autopipe/frontend/tracing/graph.py for why every layer is a contiguous run
of nodes in graph order.
"""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from autopipe.frontend.tracing.capture import Capture
from executor._torch_compat import tree_leaves

__all__ = ["group_layers", "layer_attributes", "is_cheap", "value_bytes"]

# Ops that move no data or only reinterpret it: merged into a neighbouring layer.
_CHEAP_METHODS = {
    "view", "view_as", "reshape", "size", "dim", "transpose", "permute", "contiguous",
    "unsqueeze", "squeeze", "flatten", "unflatten", "split", "chunk", "expand", "expand_as",
    "t", "numel", "unbind", "detach",
}
_CHEAP_FUNCTIONS: set[Any] = {
    operator.getitem, getattr, torch.flatten, torch.reshape, torch.transpose, torch.permute,
    torch.split, torch.chunk, torch.squeeze, torch.unsqueeze, torch.t, torch.unbind,
    torch.detach,
}
_CHEAP_ATEN = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "permute",
    "transpose", "t", "slice", "select", "split", "split_with_sizes", "alias", "detach",
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_numel", "sym_stride",
    "contiguous", "flatten", "unflatten", "chunk", "lift_fresh_copy", "unbind",
    "sym_constrain_range_for_size", "_check_is_size",
}


def value_bytes(val: Any) -> int:
    """Bytes of every tensor inside a (possibly nested) value; 0 for non-tensors."""
    total = 0
    for leaf in tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            total += int(leaf.numel()) * leaf.element_size()
    return total


def _tensors(val: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(val) if isinstance(x, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    """What tells two traced values' memory apart (each value its own where it has none)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(t)


def is_cheap(node: fx.Node) -> bool:
    """A view, reshape, getattr or shape computation: not worth a layer of its own."""
    if node.op == "call_method":
        return node.target in _CHEAP_METHODS or not _tensors(node.meta.get("val"))
    if node.op == "call_function":
        tensors = _tensors(node.meta.get("val"))
        if tensors and not any(t.is_floating_point() or t.is_complex() for t in tensors):
            return True  # index and mask arithmetic (int / bool): no trainable work
        if node.target in _CHEAP_FUNCTIONS:
            return True
        packet = getattr(node.target, "overloadpacket", None)
        if packet is not None and getattr(packet, "__name__", "") in _CHEAP_ATEN:
            return True
        return not _tensors(node.meta.get("val"))
    if node.op == "call_module":  # e.g. torch.export's _guards_fn
        return not _tensors(node.meta.get("val"))
    return False


class _Segment:
    def __init__(self, name: str, key: str | None) -> None:
        self.name = name
        self.key = key  # module key for module layers, None for op layers
        self.nodes: list[fx.Node] = []


def group_layers(cap: Capture) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """Split the graph's nodes into contiguous layers; returns layers and node -> layer."""
    segments: list[_Segment] = []
    seen: dict[str, int] = {}
    placed: set[fx.Node] = set()
    pending: list[fx.Node] = []

    def new_segment(base: str, key: str | None) -> _Segment:
        count = seen.get(base, 0)
        seen[base] = count + 1
        seg = _Segment(base if count == 0 else f"{base}#{count}", key)
        seg.nodes.extend(pending)
        placed.update(pending)
        pending.clear()
        segments.append(seg)
        return seg

    def extend_last() -> _Segment:
        # Pending nodes precede this one in graph order: they join the same layer, or the
        # layer would stop being an interval (and an edge could point backwards).
        seg = segments[-1]
        seg.nodes.extend(pending)
        placed.update(pending)
        pending.clear()
        return seg

    for node in cap.gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        key = cap.module_key.get(node.name)
        if key is not None:
            last = segments[-1] if segments else None
            if cap.source == "export" and last is not None and last.key == key:
                seg = extend_last()  # export: one leaf module call spans several ATen nodes
            else:
                seg = new_segment(key, key)
        elif is_cheap(node):
            if segments and any(i in placed for i in node.all_input_nodes):
                seg = extend_last()
            else:
                pending.append(node)
                continue
        else:
            seg = new_segment(node.name if node.name not in seen else f"{node.name}_op", None)
        seg.nodes.append(node)
        placed.add(node)
    if pending:
        if segments:
            segments[-1].nodes.extend(pending)
        else:
            new_segment("graph", None)
    node_layer = {n.name: s.name for s in segments for n in s.nodes}
    position = {n: i for i, n in enumerate(cap.gm.graph.nodes)}
    for node in cap.gm.graph.nodes:
        if node.op != "get_attr":
            continue
        users = [u for u in node.users if u.name in node_layer]
        first = min(users, key=position.__getitem__) if users else None
        node_layer[node.name] = node_layer[first.name] if first else segments[0].name
    members: dict[str, list[str]] = {s.name: [] for s in segments}
    for node in cap.gm.graph.nodes:
        if node.name in node_layer:
            members[node_layer[node.name]].append(node.name)
    return list(members.items()), node_layer


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _layer_tensors(
    cap: Capture, nodes: list[fx.Node]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Parameters and buffers (incl. constants) a layer's nodes use, each object once."""
    params: dict[int, torch.Tensor] = {}
    buffers: dict[int, torch.Tensor] = {}
    attrs = {i for n in nodes for i in n.all_input_nodes if i.op == "get_attr"}
    attrs.update(n for n in nodes if n.op == "get_attr" and n.users)
    for node in [*nodes, *sorted(attrs, key=lambda n: n.name)]:
        if node.op == "call_module":
            sub = cap.gm.get_submodule(str(node.target))
            params.update((id(p), p) for p in sub.parameters())
            buffers.update((id(b), b) for b in sub.buffers())
        elif node.op == "get_attr":
            obj = _attr(cap.gm, str(node.target))
            if isinstance(obj, nn.Parameter):
                params[id(obj)] = obj
            elif isinstance(obj, torch.Tensor):
                buffers[id(obj)] = obj
            elif isinstance(obj, nn.Module):
                params.update((id(p), p) for p in obj.parameters())
                buffers.update((id(b), b) for b in obj.buffers())
    return list(params.values()), list(buffers.values())


def layer_attributes(
    cap: Capture,
    model: nn.Module,
    layers: list[tuple[str, list[str]]],
    node_layer: dict[str, str],
) -> tuple[nx.DiGraph, list[str], int]:
    """Build the layer DiGraph with per-layer bytes, shapes and tie groups."""
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    canon: dict[int, str] = {}
    aliases: dict[int, int] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        canon.setdefault(id(param), pname)
        aliases[id(param)] = aliases.get(id(param), 0) + 1
    users: dict[int, list[str]] = {}
    per_layer: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for name, nodes in layers:
        params, buffers = _layer_tensors(cap, [by_name[n] for n in nodes])
        per_layer[name] = (params, buffers)
        for p in params:
            users.setdefault(id(p), []).append(name)

    g = nx.DiGraph()
    seen_buffers: set[int] = set()
    # [Note: receive buffers] in autopipe/core/stage_memory.py: what the model returns is charged to
    # the layer that made its memory (a returned ``.float()`` of fp32 logits is the lm_head's)
    made_by: dict[int, str] = {}
    returned_by: dict[str, int] = {}
    for name, nodes in layers:
        params, buffers = per_layer[name]
        owned = [p for p in params if users[id(p)][0] == name]
        shared = [p for p in params if users[id(p)][0] != name]
        ties = sorted(
            {canon.get(id(p), name) for p in params if len(users[id(p)]) > 1 or aliases.get(id(p), 1) > 1}
        )
        fresh_buffers = [b for b in buffers if id(b) not in seen_buffers]
        seen_buffers.update(id(b) for b in buffers)
        outs = [
            by_name[n] for n in nodes
            if by_name[n].op != "get_attr"
            and any(u.op == "output" or node_layer.get(u.name) != name for u in by_name[n].users)
        ]
        out_tensors = [t for o in outs for t in _tensors(o.meta.get("val"))]
        returned = [t for o in outs if any(u.op == "output" for u in o.users) for t in _tensors(o.meta.get("val"))]
        for t in out_tensors:
            made_by.setdefault(_storage_key(t), name)
        for t in returned:
            maker = made_by.get(_storage_key(t), name)
            returned_by[maker] = returned_by.get(maker, 0) + int(t.numel()) * t.element_size()
        key_nodes = [by_name[n] for n in nodes if cap.module_key.get(n) is not None]
        is_module = bool(key_nodes) and cap.module_key.get(key_nodes[0].name) == name.split("#")[0]
        first = key_nodes[0] if is_module else next(
            (by_name[n] for n in nodes if not is_cheap(by_name[n]) and by_name[n].op != "get_attr"),
            by_name[nodes[0]],
        )
        g.add_node(
            name,
            kind="module" if is_module else "op",
            module_type=cap.module_type.get(name.split("#")[0], "") if is_module else _op_name(first),
            nodes=list(nodes),
            params=sorted(canon.get(id(p), "?") for p in params),
            param_shapes=sorted(str(list(p.shape)) for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in owned),
            shared_bytes=sum(p.numel() * p.element_size() for p in shared),
            buffer_bytes=sum(b.numel() * b.element_size() for b in fresh_buffers),
            output_bytes=sum(int(t.numel()) * t.element_size() for t in out_tensors),
            returned_bytes=0,  # below, once every layer is seen
            output_shapes=[list(map(int, t.shape)) for t in out_tensors],
            output_dtypes=[str(t.dtype).replace("torch.", "") for t in out_tensors],
            tie_group=";".join(ties),
        )
    for name, nbytes in returned_by.items():
        g.nodes[name]["returned_bytes"] = nbytes
    for node in cap.gm.graph.nodes:
        src = node_layer.get(node.name)
        if src is None or node.op == "get_attr":
            continue
        nbytes = value_bytes(node.meta.get("val"))
        for dst in {node_layer[u.name] for u in node.users if u.name in node_layer} - {src}:
            if g.has_edge(src, dst):
                g.edges[src, dst]["bytes"] += nbytes
            else:
                g.add_edge(src, dst, bytes=nbytes)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    input_bytes = sum(value_bytes(n.meta.get("val")) for n in placeholders)
    return g, [n.name for n in placeholders], input_bytes


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return f"aten.{packet.__name__}"
    return getattr(target, "__name__", str(target))
