"""trace(model, example_inputs) -> LayerGraph: the model as a DAG of layers.

A layer is a leaf-module call or a tensor op (or a whole submodule at coarser granularity:
``leaf_modules=`` / ``max_depth=``). Cheap ops (views, getattr, reshapes, shape arithmetic) are
merged into a neighbouring layer instead of being layers of their own.

[Note: layers are intervals] Every layer is a contiguous run of the captured GraphModule's nodes
in graph order (get_attr nodes excepted: they join the layer of their first user). Because the
graph order is topological, intervals can never form a cycle, so any grouping we pick is a valid
DAG and any prefix of layers is a valid pipeline cut. torch.fx's split_module relies on exactly
this when autopipe.build cuts the graph into stages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from autopipe.core.units import format_bytes
from autopipe.frontend.tracing.capture import Capture, LeafSpec, capture
from autopipe.frontend.tracing.counted_loss import CountedLoss, counted_loss
from autopipe.frontend.tracing.granularity import coarsen, mark_grouped
from autopipe.frontend.tracing.grouping import group_layers, layer_attributes
from autopipe.frontend.tracing.repeated import capture_repeated
from autopipe.frontend.tracing.tensor_parallel import find_tensor_parallel

__all__ = ["LayerGraph", "trace"]


@dataclass
class LayerGraph:
    """A traced model: the GraphModule, its layers as a networkx DiGraph, and a fingerprint.

    Node attributes of ``nx`` (one node per layer): ``kind`` ("module" or "op"),
    ``module_type``, ``nodes`` (fx node names), ``params`` (canonical parameter names used),
    ``param_bytes`` (each parameter counted once, at its first user), ``shared_bytes`` (tied
    parameter bytes used here but counted at another layer), ``buffer_bytes``,
    ``output_bytes``, ``returned_bytes`` (what the model returns of the memory this layer made:
    a returned no-op ``.float()`` of another layer's output is that layer's), ``output_shapes``,
    ``output_dtypes``, ``tie_group`` ("" when none), ``tp_role``, ``tp_group``, ``tp_divides``
    (its part in tensor parallelism: [Note: tensor-parallel structure] in tensor_parallel.py).
    Edge attribute: ``bytes`` moved from one layer to the next at the example batch.
    ``grouped``: layers merged from finer traced ones, each with how many it holds ([Note:
    automatic granularity] in granularity.py); empty when none were.
    """

    gm: fx.GraphModule
    nx: nx.DiGraph
    layers: list[str]
    node_layer: dict[str, str]  # fx node name -> layer name (placeholders and output excluded)
    input_names: list[str]  # every placeholder: the positional inputs, then constant kwargs
    input_bytes: int
    source: str
    num_args: int = 1  # how many of input_names are the model's inputs (then keyword inputs)
    kwargs: dict[str, Any] = field(default_factory=dict)
    keywords: tuple[str, ...] = ()  # the last len(keywords) of the num_args inputs, by name
    loss: CountedLoss | None = None  # the model's own mean loss, if it returns one
    fingerprint: str = ""
    grouped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = _fingerprint(self)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return (
            f"LayerGraph({len(self.layers)} layers, {self.nx.number_of_edges()} edges, "
            f"{self.param_bytes / 2**20:.2f} MiB params, source={self.source!r}, "
            f"fingerprint={self.fingerprint!r})"
        )

    def layer(self, name: str) -> dict[str, Any]:
        """The attributes of one layer."""
        if name not in self.nx:
            raise KeyError(f"no layer {name!r}; layers are {self.layers[:5]}...")
        return dict(self.nx.nodes[name])

    @property
    def param_bytes(self) -> int:
        return sum(int(self.nx.nodes[n]["param_bytes"]) for n in self.layers)

    @property
    def tie_groups(self) -> dict[str, list[str]]:
        """Tie group id -> the layers that use a parameter of that group."""
        groups: dict[str, list[str]] = {}
        for n in self.layers:
            for g in filter(None, str(self.nx.nodes[n]["tie_group"]).split(";")):
                groups.setdefault(g, []).append(n)
        return groups

    def edges(self) -> list[tuple[str, str, int]]:
        """(src, dst, bytes) for every edge, in a stable order."""
        order = {n: i for i, n in enumerate(self.layers)}
        out = [(u, v, int(d["bytes"])) for u, v, d in self.nx.edges(data=True)]
        return sorted(out, key=lambda e: (order[e[0]], order[e[1]]))

    def is_chain(self) -> bool:
        """True when the layers form a simple path (every edge joins consecutive layers)."""
        order = {n: i for i, n in enumerate(self.layers)}
        return all(order[v] == order[u] + 1 for u, v in self.nx.edges)

    def summary(self) -> str:
        """A table of layers: name, kind, type, params, output."""
        rows = [f"{'layer':<40} {'kind':<7} {'type':<22} {'params':>10} {'output':>10}"]
        for n in self.layers:
            a = self.nx.nodes[n]
            rows.append(
                f"{n[:40]:<40} {a['kind']:<7} {str(a['module_type'])[:22]:<22} "
                f"{format_bytes(a['param_bytes']):>10} {format_bytes(a['output_bytes']):>10}"
            )
        return "\n".join(rows)


def _fingerprint(g: LayerGraph) -> str:
    """``FULL.STRUCTURE``: a stable hash of structure, shapes and dtypes (same model + batch
    shape -> same FULL), then a hash of the structure alone (layers, their types, parameter
    shapes, edges), which stays the same when only the micro-batch shape changes.

    [Note: two-part fingerprint] FULL is the whole fingerprint of older profiles and plans, so
    they still match; the STRUCTURE part lets a mismatch say whether the model or the
    micro-batch shape differs (autopipe.core.profile_table.fingerprint_mismatch).
    """
    items: list[Any] = [g.source, g.input_bytes]
    structure: list[Any] = []
    for n in g.layers:
        a = g.nx.nodes[n]
        items.append(
            [n, a["kind"], a["module_type"], a["param_shapes"], a["output_shapes"], a["output_dtypes"]]
        )
        structure.append([n, a["kind"], a["module_type"], a["param_shapes"]])
    items.append(g.edges())
    structure.append([(u, v) for u, v, _ in g.edges()])

    def digest(value: Any, size: int) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:size]

    return f"{digest(items, 16)}.{digest(structure, 8)}"


def trace(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor,
    *,
    leaf_modules: LeafSpec = None,
    max_depth: int | None = None,
    kwargs: Mapping[str, Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    repeated: bool = False,
) -> LayerGraph:
    """Trace ``model`` on ``example_inputs`` into a :class:`LayerGraph`.

    Args:
        model: any nn.Module.
        example_inputs: positional inputs of one batch (a tensor or a tuple).
        leaf_modules: module types or qualified names to keep whole as single layers.
        max_depth: keep every submodule at this depth (1 = the model's children) whole.
            Without either, layers far finer than their modules are grouped back to them
            ([Note: automatic granularity]); either one (``leaf_modules=[]`` too) keeps every
            traced layer as it is.
        kwargs: constant keyword arguments (e.g. ``{"use_cache": False}``); HuggingFace models
            get ``use_cache=False`` unless given.
        example_kwargs: keyword inputs of one batch (``input_ids=``, ``attention_mask=``,
            ``labels=``): tensors with a batch dimension become the graph's inputs after the
            positional ones, split into micro-batches by a pipeline; ``None``, non-tensors and
            0-dim tensors stay constants like ``kwargs`` (autopipe/frontend/tracing/keyword_inputs.py).
        repeated: a model whose longest stack of blocks holds identical ones is traced cut to
            two and to three of them and the rest repeated, checked equal to what tracing three
            gives, else traced whole ([Note: repeated blocks]: exact where checked, blind to a
            forward that branches on a block's index; ``profile(estimate=)`` traces so).

    Raises:
        TraceError: neither torch.fx nor torch.export could capture the model.
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    def whole() -> Capture:
        return capture(model, inputs, kwargs=kwargs, example_kwargs=example_kwargs,
                       leaf_modules=leaf_modules, max_depth=max_depth)

    grown = capture_repeated(model, whole) if repeated else None  # [Note: repeated blocks]
    cap = grown if isinstance(grown, Capture) else whole()
    layers, node_layer = group_layers(cap)
    grouped: dict[str, int] = {}
    if leaf_modules is None and max_depth is None:
        layers, node_layer, grouped = coarsen(cap, layers, node_layer)
    graph, input_names, input_bytes = layer_attributes(cap, model, layers, node_layer)
    mark_grouped(graph, model, grouped)
    names = [name for name, _ in layers]
    structure = find_tensor_parallel(cap.gm, node_layer, names)  # [Note: tensor-parallel structure]
    for name, found in structure.roles.items():
        graph.nodes[name].update(tp_role=found.role, tp_group=found.group, tp_divides=found.divides)
    return LayerGraph(
        gm=cap.gm,
        nx=graph,
        layers=names,
        node_layer=node_layer,
        input_names=input_names,
        input_bytes=input_bytes,
        source=cap.source,
        num_args=len(inputs) + len(cap.keywords),
        kwargs=cap.kwargs,
        keywords=cap.keywords,
        loss=counted_loss(cap.gm, len(inputs) + len(cap.keywords)),
        grouped=grouped,
    )
