"""Capture a model as one flat torch.fx GraphModule: torch.fx first, torch.export as fallback.

The result is a :class:`Capture`: the GraphModule, which of its nodes belong to which leaf
module (``module_key``), and every node's output value as a fake tensor (``node.meta["val"]``),
so that grouping nodes into layers and measuring shapes never runs the model for real.

[Note: two tracers, one contract] ``torch.fx.symbolic_trace`` gives a readable graph of
module calls and tensor ops, and keeps leaf modules whole, but fails on kwargs-heavy or dynamic
forwards (HuggingFace GPT-2 / Llama / BERT). ``torch.export`` handles those, and gives an ATen
graph whose nodes carry ``nn_module_stack``; we group those ATen nodes back into the same leaf
granularity. Downstream code only sees "node -> module key or None" and never asks which tracer
ran.

Either way the graph is then made to serve ``train()`` and ``eval()`` ([Note: train and eval in
one graph], modes.py) and other input sizes ([Note: dynamic sizes], shapes.py), torch's own
output is kept quiet ([Note: a quiet tracer], diagnose.py), and a failure is one TraceError
line naming the user's line of code and the fix that applies (failures.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autopipe.errors import TraceError, first_line
from autopipe.frontend.tracing.diagnose import quiet, user_line
from autopipe.frontend.tracing.failures import (
    Failure,
    advice,
    graph_failure,
    refuse_batched_kwargs,
    untraceable,
)
from autopipe.frontend.tracing.keyword_inputs import (
    export_dynamic_by_name,
    order_placeholders,
    split_keywords,
)
from autopipe.frontend.tracing.modes import ModeBinding, bind_modes
from autopipe.frontend.tracing.node_values import record_values
from autopipe.frontend.tracing.shapes import (
    add_input_check,
    export_dynamic_shapes,
    export_rules,
    fx_rules,
)
from executor._torch_compat import (
    fake_dispatch_cache_off,
    tree_leaves,
    tree_map_only,
)

__all__ = ["Capture", "capture", "LeafSpec", "default_kwargs"]

LeafSpec = Sequence[type[nn.Module] | str] | None


@dataclass
class Capture:
    gm: fx.GraphModule
    source: str  # "fx" or "export"
    module_key: dict[str, str | None]  # node name -> qualified leaf-module name, or None
    module_type: dict[str, str] = field(default_factory=dict)  # leaf-module name -> type name
    kwargs: dict[str, Any] = field(default_factory=dict)  # concrete kwargs baked into the graph
    keywords: tuple[str, ...] = ()  # keyword inputs: the last of the graph's inputs, in order
    modes: ModeBinding = field(default_factory=ModeBinding)  # train/eval in one graph, or not


def _is_default_leaf(m: nn.Module) -> bool:
    """Modules without children (Linear, Conv, norms, a custom RMSNorm) are leaves, and so is
    MultiheadAttention, whose forward branches on tensor properties. Composite modules
    (Transformer, TransformerEncoder[Layer], containers, user blocks) are traced into."""
    return isinstance(m, nn.MultiheadAttention) or next(m.children(), None) is None


class _LeafRule:
    """Which submodules are kept whole as single layers."""

    def __init__(self, leaf_modules: LeafSpec, max_depth: int | None) -> None:
        if max_depth is not None and max_depth < 1:
            raise TraceError(f"max_depth must be >= 1 (got {max_depth}); use 1 for top-level children")
        self.types = tuple(t for t in (leaf_modules or ()) if isinstance(t, type))
        self.names = {t for t in (leaf_modules or ()) if isinstance(t, str)}
        bad = [t for t in (leaf_modules or ()) if not isinstance(t, type | str)]
        if bad:
            raise TraceError(
                f"leaf_modules entries must be nn.Module types or qualified names, got {bad!r}"
            )
        self.max_depth = max_depth

    def __call__(self, m: nn.Module, qualname: str) -> bool:
        if qualname == "":
            return False
        if qualname in self.names or (self.types and isinstance(m, self.types)):
            return True
        if self.max_depth is not None and qualname.count(".") + 1 >= self.max_depth:
            return True
        return _is_default_leaf(m)


class _Tracer(fx.Tracer):
    def __init__(self, rule: _LeafRule) -> None:
        super().__init__()
        self.rule = rule
        self.failed_in: str = ""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.rule(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        path = self.path_of_module(m)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            self.failed_in = self.failed_in or path  # innermost module where tracing broke
            raise


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Every module in ``training`` mode inside; each module's own flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = training
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers as they were, whatever tracing ran: under FakeTensorMode an in-place
    op on a real 0-dim tensor still runs for real (BatchNorm's ``num_batches_tracked += 1``)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _trace_fx(
    model: nn.Module, rule: _LeafRule, kwargs: Mapping[str, Any], positional: int = 0,
    keywords: tuple[str, ...] = (),
) -> tuple[fx.GraphModule | None, Failure | None]:
    tracer = _Tracer(rule)
    tracer.record_stack_traces = True  # node.meta["stack_trace"]: the user's line of a node
    try:
        graph = tracer.trace(model, concrete_args=dict(kwargs) if kwargs else None)
    except Exception as err:  # torch.fx raises many types; all mean "could not trace"
        return None, Failure("torch.fx", first_line(err), user_line(err), tracer.failed_in)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _default_to_constants(gm, kwargs)
    try:
        order_placeholders(gm, positional, keywords)
    except TraceError as err:
        return None, Failure("torch.fx", str(err), "")
    return gm, None


def _default_to_constants(gm: fx.GraphModule, kwargs: Mapping[str, Any]) -> None:
    """torch.fx keeps a constant kwarg as placeholders ``name_1``, ``name_2``... (one per leaf)
    whose default is the parameter's default, asserted equal to the constant: a graph run
    without them (every caller passes only the inputs) fails ``scale=2.0`` against ``1.0``.
    Each placeholder's default becomes the leaf it was specialized to."""
    by_target = {str(n.target): n for n in gm.graph.nodes if n.op == "placeholder"}
    for name, value in kwargs.items():
        for i, leaf in enumerate(tree_leaves(value), 1):
            node = by_target.get(f"{name}_{i}")
            if node is not None and (leaf is None or isinstance(leaf, bool | int | float | str)):
                node.args = (leaf,)
    gm.recompile()


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], dynamic: Any
) -> tuple[torch.export.ExportedProgram | None, Failure | None]:
    # A dynamic export with the fake dispatch cache off: at symbolic sizes its entries cost more
    # than the ops they save (GPT-2, Llama, BERT: 20-32% faster); a static one keeps it (faster
    # with it).
    cache = contextlib.nullcontext() if dynamic is None else fake_dispatch_cache_off()
    try:
        with cache:
            ep = torch.export.export(model, args, kwargs=dict(kwargs), strict=False,
                                     dynamic_shapes=dynamic)
    except Exception as err:
        return None, Failure("torch.export", first_line(err), user_line(err))
    return ep, None


def _trace_export(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], batched: bool = False
) -> tuple[torch.export.ExportedProgram | None, Any, Failure | None]:
    # [Note: dynamic sizes] (shapes.py): every dimension dynamic where the model allows it;
    # retried fully static, should export refuse that outright.
    dynamic: Any = (export_dynamic_by_name(model, args, kwargs) if batched  # keyword inputs
                    else export_dynamic_shapes(args) + tuple(None for _ in kwargs))  # constants
    ep, failure = _export(model, args, kwargs, dynamic)
    if ep is None:
        ep, _ = _export(model, args, kwargs, None)
        dynamic = None
    return ep, dynamic, failure


def _leaf_key_export(
    node: fx.Node, modules: Mapping[str, nn.Module], rule: _LeafRule
) -> str | None:
    """The outermost module on the node's nn_module_stack that the rule keeps whole."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        # export may prefix paths with "L['self']." style names in old versions; normalise.
        name = str(path).replace("L['self'].", "").replace("L__self___", "")
        sub = modules.get(name)
        if sub is not None and rule(sub, name):
            return name
    return None


def default_kwargs(model: nn.Module, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` and the constants a trace adds: ``use_cache=False`` for an HF model that caches."""
    out = dict(kwargs or {})
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None) and "use_cache" not in out:
        if "use_cache" in inspect.signature(model.forward).parameters:
            out["use_cache"] = False  # HF caches are not training values
    return out


def _on_model_device(model: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """[Note: traced on the model's device] The example inputs' tensors, copied to the device
    that holds every parameter and buffer of ``model`` where theirs differs: the model on the
    CPU (to be split over GPUs) and a batch already on ``cuda:0``, say. Tracing runs the graph
    on its example inputs, and an op of CPU weights and CUDA inputs runs nowhere. A model
    spread over several devices is traced on the inputs as given.

    A model built on the meta device (``with torch.device("meta")``, to profile a model too big
    for any one device layer by layer) is the same rule's case: its example inputs (token ids
    on the CPU, say) become meta tensors of the same shape and dtype. Tracing needs only shapes,
    dtypes and devices; torch.fx's fake run of a meta Linear does not run on a CPU input, and
    torch.export's fake tensors refuse the mix ("found two different devices meta, cpu" for an
    embedding before torch 2.13). The graph's devices are then meta, which layer-by-layer
    profiling retargets to its device.

    Either way, the graph's real inputs are the caller's example inputs and kwargs
    (``Capture.kwargs``), not these copies."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return args, kwargs
    (device,) = devices

    def moved(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.detach().to(device).requires_grad_(t.requires_grad)

    return tree_map_only(torch.Tensor, moved, args), tree_map_only(torch.Tensor, moved, kwargs)


def capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    kwargs: Mapping[str, Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    leaf_modules: LeafSpec = None,
    max_depth: int | None = None,
) -> Capture:
    """Trace ``model`` into a flat GraphModule with fake output values on every node; the
    batched tensors of ``example_kwargs`` are inputs after ``example_inputs`` (keyword_inputs.py)."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    rule = _LeafRule(leaf_modules, max_depth)
    batched, concrete = split_keywords(model, example_kwargs, default_kwargs(model, kwargs))
    keywords = tuple(batched)
    example_inputs = (*example_inputs, *batched.values())  # keyword inputs after positional ones
    refuse_batched_kwargs(example_inputs, concrete)
    args, traced_kwargs = _on_model_device(model, example_inputs, concrete)  # [Note: traced on the model's device]
    with quiet(), _buffers_kept(model):  # [Note: a quiet tracer]
        cap = _capture_fx(model, rule, traced_kwargs, args, keywords)
        if isinstance(cap, Failure):
            fx_failure = cap
            cap = _capture_export(model, rule, traced_kwargs, args, keywords)
            if isinstance(cap, Failure):
                raise TraceError(
                    f"cannot trace {type(model).__name__}: {fx_failure}; {cap}. "
                    + advice(example_inputs, concrete, fx_failure, cap)
                )
    cap.kwargs = concrete  # the caller's own values, which replay gives the graph
    cap.keywords = keywords
    return cap


def _capture_fx(model: nn.Module, rule: _LeafRule, kwargs: dict[str, Any],
                args: tuple[Any, ...], keywords: tuple[str, ...]) -> Capture | Failure:
    traced = model.training
    positional = len(args) - len(keywords)
    gm, failure = _trace_fx(model, rule, kwargs, positional, keywords)
    if gm is None:
        assert failure is not None
        return failure
    with _in_mode(model, not traced):  # [Note: train and eval in one graph]
        other, other_failure = _trace_fx(model, rule, kwargs, positional, keywords)
    binding = bind_modes(gm, other, traced, untraceable(traced, other_failure))
    try:
        ran = record_values(gm, args)
    except Exception as err:  # traced, but the graph does not run on these inputs
        return graph_failure(err)
    add_input_check(gm, fx_rules(gm, args, ran), len(args))
    keys = {n.name: str(n.target) if n.op == "call_module" else None for n in gm.graph.nodes}
    return _finish(model, gm, "fx", keys, kwargs, binding)


def _capture_export(model: nn.Module, rule: _LeafRule, kwargs: dict[str, Any],
                    args: tuple[Any, ...], keywords: tuple[str, ...]) -> Capture | Failure:
    traced = model.training
    inputs = args  # positional, then keyword inputs: export takes those first among its kwargs
    positional = len(args) - len(keywords)
    args, kwargs = args[:positional], {**dict(zip(keywords, inputs[positional:], strict=True)), **kwargs}
    ep, dynamic, failure = _trace_export(model, args, kwargs, bool(keywords))
    if ep is None:
        assert failure is not None
        return failure
    with _in_mode(model, not traced):  # [Note: train and eval in one graph]
        other, other_failure = _export(model, args, kwargs, None)  # static: a third of the time
        if other is None and dynamic is not None:
            other, other_failure = _export(model, args, kwargs, dynamic)
    gm = ep.module()
    binding = bind_modes(gm, other.module() if other is not None else None, traced,
                         untraceable(traced, other_failure))
    record_values(gm, tuple(tree_leaves((args, kwargs))))  # concrete sizes of the example
    add_input_check(gm, export_rules(ep, inputs), len(inputs))
    modules = dict(model.named_modules())
    keys = {n.name: _leaf_key_export(n, modules, rule) for n in gm.graph.nodes}
    return _finish(model, gm, "export", keys, kwargs, binding)


def _finish(model: nn.Module, gm: fx.GraphModule, source: str, keys: dict[str, str | None],
            kwargs: dict[str, Any], binding: ModeBinding) -> Capture:
    modules = dict(model.named_modules())
    types = {k: type(modules[k]).__name__ for k in set(keys.values()) if k and k in modules}
    return Capture(gm=gm, source=source, module_key=keys, module_type=types, kwargs=kwargs,
                   modes=binding)
