"""One graph for train() and eval(): what a tracer baked from ``module.training`` is read again
from the running module's ``training`` flag.

[Note: train and eval in one graph] Both tracers evaluate ``self.training`` while tracing, so a
graph holds the mode it was traced in: torch.export bakes ``aten.dropout(x, 0.1, True)``,
SDPA's ``dropout_p`` and BatchNorm's ``training``; torch.fx bakes
``F.dropout(x, training=self.training)`` (an ``nn.Dropout`` leaf stays a module call and
follows its own flag). capture.py therefore traces the model in both modes (the other mode at the
example's static sizes: a dynamic export costs about three times as much) and
:func:`bind_modes` lines the two graphs up (difflib over the nodes' ops, after dropping
value-preserving ``contiguous`` / ``alias`` / whole-slice nodes whose presence depends on strides
or static sizes, and the dynamic graph's size arithmetic, which matches the static graph's int
of the same value where it is used) and, where they differ only in

- a literal argument (``True``/``False``, ``0.1``/``0.0``, compared on the op's full schema so
  an omitted default counts): the argument becomes ``by_mode(self.training, train, eval)``;
- a node with no users that mutates state (BatchNorm's ``num_batches_tracked.add_(1)``),
  present in one mode only: it runs in that mode only (``run_in_mode``), copied over from the
  other graph if the traced one lacks it;

the graph serves both modes. ``self.training`` is a ``get_attr`` node, so every layer and stage
cut from the graph reads its own flag ([Note: a cut reads parameters, never receives them]),
which ``pipe.train()`` / ``pipe.eval()`` set like any module's. Anything else (a Python branch
on ``self.training`` that runs other ops, a mode in which the model cannot be traced) keeps the
traced mode only: ``check_mode`` then refuses the other mode in one line instead of silently
running the traced one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from autopipe.errors import TraceError
from autopipe.frontend.tracing.diagnose import user_line_in

__all__ = ["ModeBinding", "bind_modes", "by_mode", "run_in_mode", "check_mode", "MODE_NAMES"]

MODE_NAMES = {True: "train", False: "eval"}
_TRANSPARENT = {"contiguous", "alias", "_assert_tensor_metadata", "lift_fresh_copy"}
_SCALARS = (bool, int, float, type(None))
_SIZE_CHECKS = {"_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size"}


def by_mode(training: bool, train_value: Any, eval_value: Any) -> Any:
    """The argument a mode-dependent op gets (see [Note: train and eval in one graph])."""
    return train_value if training else eval_value


def run_in_mode(training: bool, mode: bool, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a side effect (a statistics counter) only in the mode that has it."""
    return op(*args, **kwargs) if bool(training) == mode else None


def check_mode(training: bool, traced: bool, why: str) -> None:
    """Refuse to run a graph that holds only one mode in the other mode."""
    if bool(training) != traced:
        raise TraceError(
            f"this pipeline can only run in {MODE_NAMES[traced]} mode: {why}; build another "
            f"pipeline from the model in {MODE_NAMES[not traced]} mode "
            f"(model.{MODE_NAMES[not traced]}() before autopipe.pipeline / autopipe.trace) for that"
        )


@dataclass
class ModeBinding:
    """What :func:`bind_modes` did: literals now read from the flag, side effects limited to
    one mode, and why the graph holds one mode only ("" when it serves both)."""

    selected: int = 0
    guarded: int = 0
    one_mode: str = ""


def _name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(getattr(packet, "__name__", target))
    return str(getattr(target, "__name__", target))


def _transparent(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "contiguous"
    if node.op == "call_function" and node.target is torch.ops.aten.slice.Tensor:
        return _whole_slice(*node.args[1:])  # x[:, :]: a dynamic export keeps it, a static drops it
    return node.op == "call_function" and _name(node.target) in _TRANSPARENT


def _whole_slice(dim: Any = 0, start: Any = None, end: Any = None, step: Any = 1) -> bool:
    return start in (0, None) and (end is None or (type(end) is int and end >= 2**62)) and step == 1


def _shape(node: fx.Node) -> bool:
    """Arithmetic on sizes, or a check of them: a dynamic export has these where a static one
    has plain ints (see the Note)."""
    if node.op != "call_function":
        return False
    if isinstance(node.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat):
        return True
    return _name(node.target) in _SIZE_CHECKS


def _size_of(x: Any, y: Any) -> bool:
    """``x``, a size node of the dynamic graph, is the static graph's int ``y`` at the example."""
    if not (isinstance(x, fx.Node) and _shape(x)) or isinstance(y, fx.Node):
        return False
    hint = getattr(getattr(x.meta.get("val"), "node", None), "hint", None)
    return hint is None or (type(y) is type(hint) and hint == y)


def _signature(node: fx.Node) -> str:
    return "placeholder" if node.op == "placeholder" else f"{node.op}:{node.target}"


def _mutates(node: fx.Node) -> bool:
    name = _name(node.target) if node.op == "call_function" else str(node.target)
    return node.op in ("call_function", "call_method") and name.endswith("_") and not name.startswith("_")


def _arguments(node: fx.Node) -> tuple[dict[Any, Any], bool]:
    """The node's arguments by schema name (defaults filled in) where torch knows the schema,
    else by position / keyword; and whether they are by name."""
    if node.op == "call_function":
        try:
            found = normalize_function(node.target, node.args, dict(node.kwargs),  # type: ignore[arg-type]
                                       normalize_to_only_use_kwargs=True)
        except Exception:  # noqa: BLE001 - an unknown callable: compare as written
            found = None
        if found is not None:
            return dict(found.kwargs), True
    out: dict[Any, Any] = dict(enumerate(node.args))
    out.update(node.kwargs)
    return out, False


class _Aligner:
    """The two graphs' nodes lined up, and the differences found (see the Note)."""

    def __init__(self, primary: fx.GraphModule, other: fx.GraphModule) -> None:
        self.alias: dict[fx.Node, fx.Node] = {}
        self.a = self._comparable(primary)
        self.b = self._comparable(other)
        self.match: dict[fx.Node, fx.Node] = {}  # other's node -> primary's node
        self.literals: list[tuple[fx.Node, Any, Any, Any]] = []  # (node, key, primary, other)
        self.only_a: list[fx.Node] = []
        self.only_b: list[fx.Node] = []
        self.problem: fx.Node | None = None

    def _comparable(self, gm: fx.GraphModule) -> list[fx.Node]:
        out = []
        for node in gm.graph.nodes:
            if _shape(node):  # compared where they are used, against the other graph's ints
                continue
            if _transparent(node):
                inputs = node.all_input_nodes
                if inputs:
                    self.alias[node] = inputs[0]
                continue
            out.append(node)
        return out

    def resolve(self, node: fx.Node) -> fx.Node:
        while node in self.alias:
            node = self.alias[node]
        return node

    def run(self) -> None:
        matcher = difflib.SequenceMatcher(
            None, [_signature(n) for n in self.a], [_signature(n) for n in self.b], autojunk=False
        )
        pairs: list[tuple[fx.Node, fx.Node]] = []
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                pairs += zip(self.a[i1:i2], self.b[j1:j2], strict=True)
            else:
                self.only_a += self.a[i1:i2]
                self.only_b += self.b[j1:j2]
        for a, b in pairs:
            self.match[b] = a
        for a, b in pairs:
            if not self._same_arguments(a, b):
                self.problem = self.problem or a

    def _same_arguments(self, a: fx.Node, b: fx.Node) -> bool:
        args_a, named_a = _arguments(a)
        args_b, named_b = _arguments(b)
        if named_a != named_b or set(args_a) != set(args_b):
            return False
        for key in args_a:
            x, y = args_a[key], args_b[key]
            if self._same(x, y):
                continue
            if isinstance(x, _SCALARS) and isinstance(y, _SCALARS):
                self.literals.append((a, key, x, y))
                continue
            return False
        return True

    def _same(self, x: Any, y: Any) -> bool:
        if _size_of(x, y) or _size_of(y, x):
            return True
        if isinstance(x, fx.Node) and isinstance(y, fx.Node) and _shape(x) and _shape(y):
            return x.target == y.target and self._same((x.args, x.kwargs), (y.args, y.kwargs))
        if isinstance(x, fx.Node) or isinstance(y, fx.Node):
            if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
                return False
            return self.match.get(self.resolve(y)) is self.resolve(x)
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(map(self._same, x, y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(self._same(x[k], y[k]) for k in x)
        if isinstance(x, slice) and isinstance(y, slice):  # x[:, :n] with n a node of each graph
            return all(map(self._same, (x.start, x.stop, x.step), (y.start, y.stop, y.step)))
        try:
            return type(x) is type(y) and bool(x == y)
        except Exception:  # noqa: BLE001 - e.g. a tensor constant: equal only if the same object
            return x is y


def _side_effect(node: fx.Node) -> bool:
    return not node.users and _mutates(node)


def _harmless(node: fx.Node) -> bool:
    """A node one graph may have and the other not without changing what either computes."""
    return node.op == "get_attr" or _side_effect(node)


def _describe(node: fx.Node, mode: bool) -> str:
    where = user_line_in(node.meta.get("stack_trace"))
    op = _name(node.target) if node.op == "call_function" else str(node.target)
    return (f"the model runs {op!r} in {MODE_NAMES[mode]} mode only"
            + (f" (at {where})" if where else "") + ", a path the traced graph cannot switch")


def bind_modes(
    primary: fx.GraphModule, other: fx.GraphModule | None, traced: bool, why_not: str = ""
) -> ModeBinding:
    """Make ``primary`` (traced with ``training=traced``) serve both modes where ``other`` (the
    other mode's trace, or None when it failed: ``why_not``) shows how; see the Note."""
    graph = primary.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):  # not graph.get_attr: that warns for a non-tensor
        training = graph.create_node("get_attr", "training")
    primary.training = traced  # the flag starts in the traced mode, as the model was
    binding = ModeBinding()
    if other is not None:
        aligner = _Aligner(primary, other)
        aligner.run()
        problem = next((n for n in aligner.only_a if not _harmless(n)), aligner.problem)
        if problem is not None:
            why_not = _describe(problem, traced)
        else:
            blocker = next((n for n in aligner.only_b if not _harmless(n)), None)
            if blocker is not None:
                why_not = _describe(blocker, not traced)
        if not why_not:
            _apply(primary, aligner, training, traced, binding)
    if why_not:
        with graph.inserting_after(training):
            graph.call_function(check_mode, (training, traced, why_not))
        binding.one_mode = why_not
    if not training.users:  # nothing depends on the mode
        graph.erase_node(training)
    primary.recompile()
    return binding


def _apply(primary: fx.GraphModule, aligner: _Aligner, training: fx.Node, traced: bool,
           binding: ModeBinding) -> None:
    graph = primary.graph
    for node, key, mine, theirs in aligner.literals:
        train_value, eval_value = (mine, theirs) if traced else (theirs, mine)
        with graph.inserting_before(node):
            select = graph.call_function(by_mode, (training, train_value, eval_value))
        args, named = _arguments(node)
        args[key] = select
        if named:
            node.args, node.kwargs = (), args
        else:
            positional = sorted(k for k in args if isinstance(k, int))
            node.args = tuple(args[k] for k in positional)
            node.kwargs = {k: v for k, v in args.items() if not isinstance(k, int)}
        binding.selected += 1
    for node in aligner.only_a:  # side effects of the traced mode only
        if _side_effect(node):
            _guard(node, training, traced)
            binding.guarded += 1
    order = {n: i for i, n in enumerate(aligner.b)}
    for node in aligner.only_b:  # the other mode's side effects, copied in to run there only
        def inside(n: fx.Node) -> fx.Node:
            return aligner.match[aligner.resolve(n)]

        if node.op == "get_attr":  # the state it touches
            with graph.inserting_after(training):
                aligner.match[node] = graph.node_copy(node, inside)
            continue
        before = [b for b in aligner.b[: order[node]] if b in aligner.match and b.op != "get_attr"]
        anchor = aligner.match[before[-1]] if before else training
        with graph.inserting_after(anchor):
            copy = graph.node_copy(node, inside)
        _guard(copy, training, not traced)
        binding.guarded += 1


def _guard(node: fx.Node, training: fx.Node, mode: bool) -> None:
    """``op(*args)`` -> ``run_in_mode(training, mode, op, *args)``."""
    op: Any = node.target
    if node.op == "call_method":  # x.add_(1): the Tensor method
        op = getattr(torch.Tensor, str(node.target))
    node.op = "call_function"
    node.target = run_in_mode
    node.args = (training, mode, op, *node.args)
