"""Stage modules of a model built on the meta device, made real one stage at a time.

    for stage, device in zip(stages, devices):
        materialize(stage, device, tensors=index, weights=source, key_map=match, init=None)

[Note: materialise per stage] torchtitan's recipe: build the model under
``torch.device("meta")`` (no memory), cut it into stages, then give each stage real tensors on
its own device, from a weights file or from an initialiser. A stage's tensors are referenced
from several places: the submodules of the user's model, and the stage GraphModule, which
holds its own references under the original qualified names ([Note: stage parameters are the
model's] in frontend/building/stages.py). :class:`TensorIndex` finds every (module, attribute) that
holds a tensor, across the model and all stages, so replacing a meta tensor replaces it
everywhere at once and a tied parameter stays one Parameter object. A tensor that is already
real (a tie materialised by an earlier stage) is left as it is. Only the stage's own tensors
are ever allocated, so the peak is one stage plus what reading its weights needs.

Without weights, a stage's tensors get ``torch.empty`` storage on the device and each module
that holds one is initialised: by ``init(module)`` when given, else by its own
``reset_parameters()``; a module with neither is an error naming it. Initialisation is seeded
per module from its qualified name ([Note: seeded per module]), so every rank of a
distributed pipeline and the one-process pipeline give a module the same initial values
whichever stage it lands in.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.errors import BuildError
from autopipe.frontend.building.weights import (
    TensorInfo,
    Weights,
    WeightSource,
    match_weights,
    open_weights,
)

__all__ = ["TensorIndex", "has_meta_tensors", "materialize", "materialize_stages",
           "retarget_graph_module"]

Init = Callable[[nn.Module], None]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@dataclass
class _Holder:
    module: nn.Module
    name: str
    is_param: bool


@dataclass
class TensorIndex:
    """Where every parameter and buffer of a model (and of stages cut from it) is held."""

    holders: dict[int, list[_Holder]] = field(default_factory=dict)
    keys: dict[int, list[str]] = field(default_factory=dict)  # the model's state_dict keys
    # (a tensor with keys is one the model saves: a persistent buffer or a parameter)
    owner_names: dict[int, str] = field(default_factory=dict)  # first module holding it, by name
    loaded: set[int] = field(default_factory=set)  # real tensors already overwritten from weights

    @classmethod
    def build(cls, model: nn.Module, stages: Iterable[nn.Module] = ()) -> TensorIndex:
        index = cls()
        for key, t in model.state_dict(keep_vars=True).items():
            index.keys.setdefault(id(t), []).append(key)
        for root in (model, *stages):
            for path, module in root.named_modules(remove_duplicate=False):
                for name, t in module._parameters.items():
                    if t is not None:
                        index._add(module, name, t, True, path, root is model)
                for name, t in module._buffers.items():
                    if t is not None:
                        index._add(module, name, t, False, path, root is model)
        return index

    def _add(self, module: nn.Module, name: str, t: Tensor, is_param: bool, path: str,
             in_model: bool) -> None:
        held = self.holders.setdefault(id(t), [])
        if not any(h.module is module and h.name == name for h in held):
            held.append(_Holder(module, name, is_param))
        if in_model and id(t) not in self.owner_names:
            self.owner_names[id(t)] = f"{path}.{name}" if path else name

    def expected(self, model: nn.Module) -> dict[str, TensorInfo]:
        """The model's state_dict keys with their shapes and dtypes (meta tensors have both)."""
        return {k: TensorInfo(tuple(t.shape), t.dtype)
                for k, t in model.state_dict(keep_vars=True).items()}

    def aliases(self) -> dict[str, list[str]]:
        """Each state_dict key -> the other keys naming the same tensor (tied weights)."""
        return {k: [a for a in keys if a != k] for keys in self.keys.values() if len(keys) > 1
                for k in keys}

    def replace(self, old: Tensor, new: Tensor) -> None:
        """Put ``new`` in every place that holds ``old`` (one Parameter object for a tie).

        The index stays keyed by the old (meta) tensors: only meta tensors are looked up, and a
        replaced one is real, so it is never looked up again."""
        holders = self.holders.get(id(old), [])
        param = nn.Parameter(new, requires_grad=old.requires_grad) if any(
            h.is_param for h in holders) else None
        for h in holders:
            if h.is_param:
                h.module._parameters[h.name] = param
            else:
                h.module._buffers[h.name] = new


def _stage_tensors(stage: nn.Module) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in (*stage.parameters(), *stage.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


def _seed(name: str, base: int) -> int:
    digest = hashlib.sha256(name.encode()).digest()
    return (base + int.from_bytes(digest[:8], "little")) % (2**63)


def materialize(
    stage: nn.Module,
    device: torch.device | str,
    *,
    index: TensorIndex,
    weights: WeightSource | None = None,
    key_map: Mapping[str, str] | None = None,
    init: Init | None = None,
    seed: int = 0,
) -> list[str]:
    """Give ``stage``'s meta tensors real storage on ``device`` ([Note: materialise per stage]).

    With ``weights``, every persistent tensor is read from it (``key_map``: model key -> source
    key, from :func:`autopipe.frontend.building.weights.match_weights`) and cast to the model's dtype;
    the rest (non-persistent buffers, or everything without weights) is initialised. Returns the
    qualified names of the modules that were initialised rather than loaded.
    """
    device = torch.device(device)
    tensors = _stage_tensors(stage)
    todo = [t for t in tensors if t.is_meta]
    # with weights, every tensor the model saves is loaded: a meta one is replaced, a real one
    # (a model built normally, or a tie an earlier stage loaded) is overwritten in place
    from_file = {id(t): index.keys[id(t)][0] for t in tensors
                 if weights is not None and id(t) in index.keys
                 and id(t) not in index.loaded}
    if weights is not None and from_file:
        assert key_map is not None
        wanted = {key_map[key] for key in from_file.values()}
        read = weights.read(sorted(wanted), device)
        for t in tensors:
            if id(t) not in from_file:
                continue
            value = read[key_map[from_file[id(t)]]]
            if t.is_meta:
                index.replace(t, value.to(device=device, dtype=t.dtype))
            else:
                with torch.no_grad():
                    t.copy_(value)
                index.loaded.add(id(t))
    fresh = [t for t in todo if id(t) not in from_file]
    if not fresh:
        return []
    modules: dict[str, nn.Module] = {}
    for t in fresh:
        name = index.owner_names.get(id(t), "?")
        holder = index.holders[id(t)][0]
        modules.setdefault(name.rpartition(".")[0], holder.module)
    for path, module in modules.items():
        if init is None and not callable(getattr(module, "reset_parameters", None)):
            kind = "non-persistent buffers (not in weights files)" if weights is not None else "tensors"
            raise BuildError(
                f"module {path or '<model>'!r} ({type(module).__name__}) has {kind} on the meta "
                "device and no reset_parameters(); pass init=fn, called as fn(module) for each such "
                "module (e.g. a HuggingFace model's model._init_weights), or weights=")
    for t in fresh:
        index.replace(t, torch.empty_like(t, device=device))
    for path, module in sorted(modules.items()):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_seed(path, seed))
            with torch.no_grad():
                if init is not None:
                    init(module)
                else:
                    module.reset_parameters()  # type: ignore[operator]
    return sorted(modules)


def retarget_meta_devices(graph: torch.fx.Graph, device: torch.device) -> bool:
    """Replace, in place, every meta device baked into ``graph``'s calls with ``device``; True
    when something changed (a GraphModule then needs ``recompile()``).

    torch.export bakes the device of factory calls (``arange(..., device=meta)``) and of its
    tensor-metadata assertions into the graph: a graph traced from a model on the meta device
    would otherwise create meta tensors, or fail its assertions, on a real device. This sees one
    graph only; :func:`retarget_graph_module` also sees the graphs nested in it."""
    changed = False

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed = True
            return device
        return value

    for node in graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)  # type: ignore[assignment]
    return changed


def _holds_meta_device(gm: torch.fx.GraphModule) -> bool:
    found = False

    def look(value: Any) -> Any:
        nonlocal found
        found = found or (isinstance(value, torch.device) and value.type == "meta")
        return value

    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                torch.fx.node.map_aggregate((node.args, node.kwargs), look)
    return found


def retarget_graph_module(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """:func:`retarget_meta_devices` on ``gm`` and on every graph nested in it, recompiled.

    [Note: nested graphs] torch.export writes the body of a higher-order op as a GraphModule
    attribute that a ``get_attr`` node reads: ``wrap_with_set_grad_enabled(False, submod_1, ...)``
    for a ``@torch.no_grad()`` forward (transformers 5.17's rotary embedding),
    ``wrap_with_autocast`` for an autocast block. Such a body bakes meta devices in as the outer
    graph does, and ``fx.GraphModule(root, graph)`` shares it by reference with the traced graph
    it was cut from. So a nested body that holds a meta device is replaced by a retargeted deep
    copy: the traced graph keeps its meta devices, and other stages or layers cut from it can
    still be retargeted to their own devices."""
    if retarget_meta_devices(gm.graph, device):
        gm.recompile()
    for name, child in gm._modules.items():
        # a body holds no tensors of its own (torch.export passes them in as arguments); a child
        # that does is the model's own module, never copied: its parameters are the model's
        if (isinstance(child, torch.fx.GraphModule) and _holds_meta_device(child)
                and next(iter((*child.parameters(), *child.buffers())), None) is None):
            body = copy.deepcopy(child)
            retarget_graph_module(body, device)
            gm._modules[name] = body


def materialize_stages(
    model: nn.Module,
    stages: Sequence[nn.Module],
    devices: Sequence[torch.device | str],
    *,
    weights: Weights | None = None,
    init: Init | None = None,
    mine: Sequence[int] | None = None,
    seed: int = 0,
) -> list[str]:
    """Load or initialise the stages ``mine`` (default: all) of ``model``, one at a time, each on
    its device ([Note: materialise per stage]); the other stages are not touched. Returns the
    modules that were initialised rather than loaded. A model without meta tensors and without
    ``weights`` is left as it is."""
    if weights is None and not has_meta_tensors(model):
        return []
    index = TensorIndex.build(model, stages)
    source = open_weights(weights) if weights is not None else None
    key_map = match_weights(source, index.expected(model), index.aliases()) if source else None
    initialised: list[str] = []
    for i in (range(len(stages)) if mine is None else mine):
        device = torch.device(devices[i])
        initialised += materialize(stages[i], device, index=index, weights=source,
                                   key_map=key_map, init=init, seed=seed)
        stage = stages[i]
        if isinstance(stage, torch.fx.GraphModule):
            retarget_graph_module(stage, device)
    return initialised
