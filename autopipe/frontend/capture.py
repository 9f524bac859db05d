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
"""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autopipe.errors import TraceError, first_line
from executor._torch_compat import tree_leaves, tree_map_only

__all__ = ["Capture", "capture", "LeafSpec"]

LeafSpec = Sequence[type[nn.Module] | str] | None


@dataclass
class Capture:
    gm: fx.GraphModule
    source: str  # "fx" or "export"
    module_key: dict[str, str | None]  # node name -> qualified leaf-module name, or None
    module_type: dict[str, str] = field(default_factory=dict)  # leaf-module name -> type name
    kwargs: dict[str, Any] = field(default_factory=dict)  # concrete kwargs baked into the graph


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


def _trace_fx(
    model: nn.Module, rule: _LeafRule, kwargs: Mapping[str, Any]
) -> tuple[fx.GraphModule | None, str]:
    tracer = _Tracer(rule)
    try:
        graph = tracer.trace(model, concrete_args=dict(kwargs) if kwargs else None)
    except Exception as err:  # torch.fx raises many types; all mean "could not trace"
        where = tracer.failed_in or "<root>"
        return None, f"torch.fx failed in module '{where}' ({first_line(err)})"
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    return gm, ""


def _trace_export(
    model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[fx.GraphModule | None, str]:
    # [Note: dynamic batch] Pipelines run micro-batches, so the batch dimension must not be
    # baked into the graph: ask export for a dynamic dim 0 on every tensor input (AUTO lets
    # export keep it static where the model forces that), and retry fully static if refused.
    batch = tuple({0: torch.export.Dim.AUTO} if isinstance(a, torch.Tensor) else None for a in args)
    batch += tuple(None for _ in kwargs)  # constant kwargs: static
    sink = io.StringIO()
    first_err: Exception | None = None
    for dynamic in (batch, None):
        try:  # export prints the partial graph on failure: keep that out of the user's terminal
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                ep = torch.export.export(
                    model, args, kwargs=dict(kwargs), strict=False, dynamic_shapes=dynamic
                )
            return ep.module(), ""
        except Exception as err:
            first_err = first_err or err
    assert first_err is not None
    return None, f"torch.export failed ({first_line(first_err)})"


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


def _fake_propagate(gm: fx.GraphModule, args: tuple[Any, ...]) -> None:
    """Store every node's output as a fake tensor in node.meta['val'] (no real activations)."""
    from executor._torch_compat import FakeTensorMode

    class _MetaRecorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            n.meta["val"] = result
            return result

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        with mode:
            _MetaRecorder(gm).run(*fake_args)
        return
    except Exception:  # an op without a fake kernel: fall back to one real forward
        pass
    with torch.no_grad():
        _MetaRecorder(gm).run(*args)
    for n in gm.graph.nodes:
        n.meta["val"] = tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), n.meta["val"]
        )


def _default_kwargs(model: nn.Module, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(kwargs or {})
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None) and "use_cache" not in out:
        if "use_cache" in inspect.signature(model.forward).parameters:
            out["use_cache"] = False  # HF caches are not training values
    return out


def capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    kwargs: Mapping[str, Any] | None = None,
    leaf_modules: LeafSpec = None,
    max_depth: int | None = None,
) -> Capture:
    """Trace ``model`` into a flat GraphModule with fake output values on every node."""
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    rule = _LeafRule(leaf_modules, max_depth)
    concrete = _default_kwargs(model, kwargs)
    gm, fx_err = _trace_fx(model, rule, concrete)
    source = "fx"
    if gm is not None:
        try:
            _fake_propagate(gm, example_inputs)
        except Exception as err:  # traced, but the graph does not run on these inputs
            gm, fx_err = None, f"torch.fx graph did not run on the example inputs ({first_line(err)})"
    if gm is None:
        gm, ex_err = _trace_export(model, example_inputs, concrete)
        source = "export"
        if gm is not None:  # concrete shapes for the example batch (export's are symbolic)
            _fake_propagate(gm, tuple(tree_leaves((example_inputs, concrete))))
        if gm is None:
            raise TraceError(
                f"cannot trace {type(model).__name__}: {fx_err}; {ex_err}. "
                "Mark the offending submodule a leaf (trace(..., leaf_modules=['path'])), pass "
                "constant arguments as kwargs=..., or remove data-dependent Python control flow"
            )
    modules = dict(model.named_modules())
    keys: dict[str, str | None] = {}
    for node in gm.graph.nodes:
        if source == "fx":
            keys[node.name] = str(node.target) if node.op == "call_module" else None
        else:
            keys[node.name] = _leaf_key_export(node, modules, rule)
    types = {k: type(modules[k]).__name__ for k in set(keys.values()) if k and k in modules}
    return Capture(gm=gm, source=source, module_key=keys, module_type=types, kwargs=concrete)
