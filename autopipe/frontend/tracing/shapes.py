"""Which input sizes a traced graph allows, and the check that says so in one line.

[Note: dynamic sizes] A pipeline runs micro-batches, and users run other sequence lengths than
the one they traced with, so no input size may be baked into the graph unless the model itself
fixes it. torch.export is asked for ``Dim.AUTO`` on every dimension of every tensor input
(dynamic where the model allows it, static where it forces a size); its ExportedProgram then
says which dimensions stayed static, the range of the others (BERT's positions: at most 512) and
which must be equal. A torch.fx graph is generic code already; a dimension it fixes (a view
to a constant size, a Linear's width) is one whose fake runs (shapes, no data) fail one larger,
one smaller and twice as large: a size that only has to fit a table (positions) or divide
evenly (pooling) passes one of them. The rules become one ``check_inputs`` node right after the
placeholders: it joins the first layer, so stage 0 of any pipeline refuses, in one line naming
the input and the dimension, inputs the graph cannot run, where torch would fail deep inside
with "shape '[4, 16, 192]' is invalid". Sizes 0 and 1 are neither made dynamic nor checked
(torch specializes them). The profile and the plan stay keyed to the traced sizes
([Note: graphs are keyed to the micro-batch]): other sizes run, at costs nobody measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autopipe.errors import TraceError
from executor._torch_compat import FakeTensorMode

__all__ = ["Rule", "export_dynamic_shapes", "export_rules", "fx_rules", "add_input_check",
           "check_inputs"]

# (kind, input, dimension, a, b): ("fixed", i, d, size, 0), ("range", i, d, low, high),
# ("same", i, d, other input, other dimension). Plain tuples: they are arguments of an fx node.
Rule = tuple[str, int, int, int, int]


def export_dynamic_shapes(args: Sequence[Any]) -> tuple[dict[int, Any] | None, ...]:
    """``Dim.AUTO`` for every dimension of size >= 2 of every tensor argument."""
    auto = torch.export.Dim.AUTO
    return tuple(
        {d: auto for d, n in enumerate(a.shape) if n >= 2} if isinstance(a, torch.Tensor) else None
        for a in args
    )


def export_rules(ep: torch.export.ExportedProgram, args: Sequence[Any]) -> tuple[Rule, ...]:
    """The sizes ``ep`` fixed, bounded or tied, for its first ``len(args)`` user inputs."""
    names = list(ep.graph_signature.user_inputs)[: len(args)]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    rules: list[Rule] = []
    first: dict[Any, tuple[int, int]] = {}
    for i, (name, example) in enumerate(zip(names, args, strict=False)):
        val = vals.get(name)
        if not isinstance(example, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        for d, (size, n) in enumerate(zip(val.shape, example.shape, strict=True)):
            if n < 2:
                continue
            if not isinstance(size, torch.SymInt) or is_concrete_int(size):
                rules.append(("fixed", i, d, int(size), 0))
                continue
            expr = size.node.expr
            if not expr.is_symbol:
                continue
            if expr in first:
                rules.append(("same", i, d, *first[expr]))
                continue
            first[expr] = (i, d)
            bounds = ep.range_constraints.get(expr)
            if bounds is None:
                continue
            # sympy Integers; torch's unbounded ends (int_oo) are not (and claim is_finite)
            low = int(bounds.lower) if bounds.lower.is_Integer and int(bounds.lower) > 2 else 0
            high = int(bounds.upper) if bounds.upper.is_Integer else 0
            if low or high:
                rules.append(("range", i, d, low, high))
    return tuple(rules)


def _runs_at(gm: fx.GraphModule, args: Sequence[Any], mode: FakeTensorMode,
             change: tuple[int, int, int] | None = None) -> bool:
    """Whether a fake run of ``gm`` succeeds on ``args``, with ``change = (i, d, size)``:
    dimension ``d`` of input ``i`` at ``size``."""
    changed = list(args)
    if change is not None:
        i, d, size = change
        shape = list(args[i].shape)
        shape[d] = size
        changed[i] = torch.zeros(shape, dtype=args[i].dtype, device=args[i].device)
    try:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in changed]
        with mode:
            fx.Interpreter(gm).run(*fakes)
    except Exception:  # noqa: BLE001 - any failure: the size does not run
        return False
    return True


def fx_rules(gm: fx.GraphModule, args: Sequence[Any], ran: FakeTensorMode | None = None) -> tuple[Rule, ...]:
    """The sizes a torch.fx graph fixes (see [Note: dynamic sizes]); () where the graph does not
    run on fake tensors at all. ``ran``: a mode (``allow_non_fake_inputs``) that a fake run of
    ``gm`` on ``args`` already succeeded under, as the tracer's own did: that run is not repeated,
    and the probes reuse its fake parameters."""
    mode = ran or FakeTensorMode(allow_non_fake_inputs=True)  # one mode: parameters converted once
    if ran is None and not _runs_at(gm, args, mode):
        return ()
    rules: list[Rule] = []
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            continue
        for d, n in enumerate(x.shape):
            if d == 0 or n < 2:  # the batch: free by construction (micro-batches)
                continue
            probes = (n + 1, n - 1, 2 * n) if n > 2 else (n + 1, 2 * n)
            if not any(_runs_at(gm, args, mode, (i, d, size)) for size in probes):
                rules.append(("fixed", i, d, int(n), 0))
    return tuple(rules)


def add_input_check(gm: fx.GraphModule, rules: tuple[Rule, ...], count: int) -> None:
    """Insert ``check_inputs(rules, names, *inputs)`` after the first ``count`` placeholders."""
    if not rules:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = placeholders[:count]
    with gm.graph.inserting_after(placeholders[-1]):
        gm.graph.call_function(check_inputs, (rules, tuple(n.name for n in inputs), *inputs))
    gm.recompile()


def _dimension(names: Sequence[str], i: int, d: int) -> str:
    batch = " (the batch: here a micro-batch)" if d == 0 else ""
    return f"dimension {d}{batch} of input '{names[i]}'"


def check_inputs(rules: tuple[Rule, ...], names: tuple[str, ...], *inputs: Any) -> None:
    """Raise TraceError, one line naming the input and dimension, on a size the graph cannot run."""
    for kind, i, d, a, b in rules:
        x = inputs[i] if i < len(inputs) else None
        if not isinstance(x, torch.Tensor) or x.dim() <= d:
            continue
        if isinstance(x.shape[d], torch.SymInt):  # a symbolic run (executor/ranks/symbolic.py):
            continue  # comparing would fix the size it is working out
        got = int(x.shape[d])
        where = _dimension(names, i, d)
        if kind == "fixed" and got != a:
            raise TraceError(
                f"{where} is {got}, but the model fixes it at {a} (it was traced at {a}, and e.g. a "
                f"view or a layer's width depends on it); pass inputs with {a} there, or make the "
                "model compute that size from its input"
            )
        if kind == "range" and (got < a or (b and got > b)):
            span = f"{a or 2}..{b}" if b else f">= {a}"
            raise TraceError(
                f"{where} is {got}, but the model allows {span} there (e.g. its number of "
                f"positions); pass inputs with a size in {span}"
            )
        if kind == "same":
            y = inputs[a] if a < len(inputs) else None
            if (isinstance(y, torch.Tensor) and y.dim() > b and isinstance(y.shape[b], int)
                    and int(y.shape[b]) != got):
                raise TraceError(
                    f"{where} is {got} but {_dimension(names, a, b)} is {int(y.shape[b])}; the "
                    "model needs them equal: pass inputs whose sizes agree"
                )
