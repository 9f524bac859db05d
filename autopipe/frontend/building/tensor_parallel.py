"""One rank's stage modules split over a tensor-parallel group: Megatron's layers, rewritten in the graph.

[Note: tensor parallelism on ranks] The tracer's groups ([Note: tensor-parallel structure] in
autopipe/frontend/tracing/tensor_parallel.py) say which fx nodes are a group's columns, its
region and its row, and which are the vocabulary's embedding and head. On TP rank j of t, each
stage GraphModule is rewritten so that it computes rank j's part, Megatron's way (Shoeybi et
al. 2019), with plain tensors inside the graph and the collectives the ``ops`` give
(executor/ranks/tensor_parallel.py: autopipe.frontend never imports a runtime):

- a ``column`` Linear keeps output rows j (weight and bias: a DTensor ``Shard(0)`` parameter,
  computed on its local tensor); its input passes ``ops.copy()`` first (identity; the input
  gradient all-reduced: Megatron's f), once per value its group's columns read. A fused q / k /
  v weight (its output split into parts in the region: the bundled gpt's ``qkv``) keeps rows j
  of each part: stored whole (replicated), its gradient all-reduced, compute split per part;
- ``sharded`` nodes run on the local heads or features: a size a view, reshape, expand or split
  names along the split dimension is divided by t where it is a constant or a size of a
  replicated value (HF Llama's -1 needs nothing; its kv-head ``expand`` constants and the
  bundled gpt's ``view(b, t, heads, hd)`` / ``reshape(b, t, c)`` do), found by following the
  split dimension from the column to the row through the region's ops (an op it cannot follow
  is refused in one line);
- a ``row`` Linear keeps input columns j (``Shard(1)``), its output all-reduced
  (``ops.reduce()``: Megatron's g), then its bias added whole (a plain parameter);
- the ``vocab_embedding`` keeps vocabulary rows j, looks up the ids in its range (the rest
  zero) and all-reduces; the ``vocab_head`` is a column whose logits are all-gathered into the
  whole vocabulary (``ops.gather()``) before the loss: every rank of the last stage computes the
  same loss on the same logits (simple and exact; a vocab-parallel loss would save the gather);
- everything else is replicated: every TP rank runs it on the same values, so a cut's values
  are whole tensors and TP rank j of stage s sends to TP rank j of stage s + 1; under sequence
  parallelism the values between groups hold rank j's tokens only ([Note: sequence parallelism
  on ranks] in autopipe/frontend/building/sequence_parallel.py).

The parameters stay under the model's names: a split one is a DTensor on the TP mesh, which
DCP saves as shards and reshards on load and FSDP2 shards again over the replicas; a tensor tied
across stages is split the same way wherever it is, so its copies stay alike.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch.nn.functional as F
from torch import Tensor, fx, nn

from autopipe.core.tensor_parallel import COLUMN, ROW, SHARDED, VOCAB_EMBEDDING, VOCAB_HEAD
from autopipe.errors import BuildError
from autopipe.frontend.building.sequence_parallel import SequenceSplit
from autopipe.frontend.tracing.tensor_parallel import op_name

__all__ = ["TensorParallelOps", "shard_stage"]


class TensorParallelOps(Protocol):
    """What a runtime gives the rewrite: this rank's place and its group's collectives as modules."""

    degree: int
    rank: int

    def copy(self, tokens: bool = False) -> nn.Module: ...  # identity forward, gradient all-reduced
    def reduce(self, tokens: bool = False) -> nn.Module: ...  # all-reduce forward, gradient as is
    def whole_tokens(self) -> nn.Module: ...  # tokens all-gathered, gradient sliced
    def slice_tokens(self) -> nn.Module: ...  # rank j's tokens, gradient all-gathered
    def gather(self) -> nn.Module: ...  # last dimension all-gathered, gradient sliced
    def part_rows(self, sizes: Sequence[int]) -> nn.Module: ...  # rows j of each part, gradient all-reduced
    def embedding(self, start: int, size: int, padding_idx: int | None, tokens: bool = False) -> nn.Module: ...
    def parameter(self, local: Tensor, dim: int, requires_grad: bool) -> nn.Parameter: ...  # DTensor Shard(dim)


_VIEWS = {"view", "reshape", "_unsafe_view"}
_MOVES = {"transpose", "swapaxes", "permute", "unsqueeze", "t"}
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split"}
_LINEARS = {"linear", "addmm", "mm", "matmul"}


def _args(node: fx.Node) -> Any:
    return node.args


def _kwargs(node: fx.Node) -> Any:
    return node.kwargs


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node: fx.Node) -> list[int]:
    val = _val(node)
    return [int(s) for s in val.shape] if isinstance(val, Tensor) else []


class _Stage:
    """One stage GraphModule being rewritten for TP rank ``ops.rank`` of ``ops.degree``."""

    def __init__(self, gm: fx.GraphModule, roles: dict[str, tuple[str, str]], ops: TensorParallelOps,
                 vocab: bool, made: dict[int, nn.Parameter]) -> None:
        self.gm, self.ops, self.t, self.j = gm, ops, ops.degree, ops.rank
        self.roles = {n: roles[n.name][0] for n in gm.graph.nodes if n.name in roles and n.op != "placeholder"
                      and (vocab or roles[n.name][1] != "vocab")}  # a cut's value is named as its maker
        self.groups = {n: roles[n.name][1] for n in self.roles}
        self.made = made  # original parameter id -> its split (shared by the stages of this rank)
        self.split: dict[fx.Node, int] = {}  # local values -> their split dimension
        self.copies: dict[tuple[fx.Node, str], fx.Node] = {}
        self.count = 0
        self.vocab = vocab
        self.sp: SequenceSplit | None = None  # [Note: sequence parallelism on ranks]

    def fail(self, node: fx.Node, why: str) -> BuildError:
        group = self.groups.get(node, "")
        return BuildError(f"tensor parallelism cannot split {node.name} ({op_name(node)}) in group {group!r}: "
                          f"{why}; use tensor_parallel=1 for this model")

    def module(self, prefix: str, mod: nn.Module, before: fx.Node) -> Callable[..., fx.Node]:
        self.count += 1
        name = f"_tp_{prefix}_{self.count}"
        self.gm.add_submodule(name, mod)

        def call(*args: Any) -> fx.Node:
            with self.gm.graph.inserting_before(before):
                return self.gm.graph.call_module(name, tuple(args))
        return call

    # --- parameters ------------------------------------------------------------------------
    def _owner(self, target: str) -> tuple[nn.Module, str]:
        prefix, _, attr = target.rpartition(".")
        return (self.gm.get_submodule(prefix) if prefix else self.gm), attr

    def _set(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """``new`` wherever the stage registers ``old`` (a tie: under each of its names)."""
        for mod in self.gm.modules():
            for attr, p in list(mod._parameters.items()):
                if p is old:
                    setattr(mod, attr, new)

    def shard(self, target: str, dim: int) -> None:
        """The parameter at ``target`` as rows / columns j of t (a DTensor), once per tensor."""
        owner, attr = self._owner(target)
        p = getattr(owner, attr)
        if any(p is split for split in self.made.values()):
            return  # split already (a tie: the embedding's, now the head's)
        if id(p) not in self.made:
            if p.shape[dim] % self.t:
                raise BuildError(f"tensor_parallel={self.t} does not divide {target}'s {p.shape[dim]} "
                                 f"{'rows' if dim == 0 else 'columns'}; use a degree that divides it")
            local = p.detach().chunk(self.t, dim)[self.j].clone()
            self.made[id(p)] = self.ops.parameter(local, dim, p.requires_grad)
        self._set(p, self.made[id(p)])

    def local(self, target: str, before: fx.Node) -> fx.Node:
        """A node of the local tensor of the split parameter at ``target``."""
        with self.gm.graph.inserting_before(before):
            attr = self.gm.graph.get_attr(target)
            return self.gm.graph.call_method("to_local", (attr,))

    def whole(self, target: str, before: fx.Node) -> fx.Node:
        with self.gm.graph.inserting_before(before):
            return self.gm.graph.get_attr(target)

    # --- the Linears -----------------------------------------------------------------------
    def linear_parts(self, node: fx.Node) -> tuple[fx.Node, str, str | None]:
        """(input, weight target, bias target) of a Linear node, or a one-line refusal."""
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            if isinstance(mod, nn.Linear):
                return node.args[0], f"{node.target}.weight", None if mod.bias is None else f"{node.target}.bias"  # type: ignore[return-value]
            raise self.fail(node, f"a {type(mod).__name__} is not split yet (nn.Linear and aten.linear are)")
        if op_name(node) == "linear" and all(isinstance(a, fx.Node) and a.op == "get_attr"
                                           for a in node.args[1:3] if a is not None):
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            return (node.args[0], str(node.args[1].target),  # type: ignore[union-attr, return-value]
                    None if bias is None else str(bias.target))  # type: ignore[union-attr]
        raise self.fail(node, "only nn.Linear and aten.linear of the model's own weights are split yet "
                              "(not a fused addmm, a Conv1D or a weight computed in the graph)")

    def copied(self, x: fx.Node, group: str, before: fx.Node) -> fx.Node:
        """``x`` through the group's f (one per value and group), placed after ``x``."""
        if (x, group) not in self.copies:  # a value split by tokens: all-gathered
            call = self.module("copy", self.ops.copy(self.tokens(x)), before)
            self.copies[(x, group)] = call(x)
        return self.copies[(x, group)]

    def tokens(self, x: fx.Node) -> bool:  # whether x holds this rank's tokens only
        return self.sp is not None and x in self.sp.values

    def replace(self, node: fx.Node, new: fx.Node) -> None:
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)

    def column(self, node: fx.Node, head: bool) -> None:
        x, weight, bias = self.linear_parts(node)
        parts = None if head else self.parts(node)
        graph = self.gm.graph
        x = self.copied(x, self.groups[node], node)
        if parts is None:
            self.shard(weight, 0)
            w = self.local(weight, node)
            if bias is not None:
                self.shard(bias, 0)
            b = None if bias is None else self.local(bias, node)
        else:  # a fused weight: each part's rows j
            w = self.module("part_rows", self.ops.part_rows(parts), node)(self.whole(weight, node))
            b = None if bias is None else self.module("part_rows", self.ops.part_rows(parts), node)(
                self.whole(bias, node))
        with graph.inserting_before(node):
            out = graph.call_function(F.linear, (x, w, b))
        out.meta = dict(node.meta)
        if head:
            gathered = self.module("gather", self.ops.gather(), node)(out)
            gathered.meta = dict(node.meta)
            self.replace(node, gathered)
            return
        self.replace(node, out)
        self.split[out] = len(_shape(out)) - 1

    def parts(self, node: fx.Node) -> list[int] | None:
        """A fused column's parts: the sizes its output is split into along its last dimension in
        the region (the bundled gpt's ``split(c, dim=2)``), or None for one part."""
        out = _shape(node)
        for user in node.users:
            if self.roles.get(user) != SHARDED or op_name(user) not in _SPLITS:
                continue
            dim = self._split_dim(user)
            if dim % len(out) != len(out) - 1:
                continue
            sizes = [s[-1] for s in (_shape_of(v) for v in _val(user))]
            if len(sizes) > 1:
                return sizes
        return None

    def row(self, node: fx.Node) -> None:
        x, weight, bias = self.linear_parts(node)
        if self.split.get(x) != len(_shape(x)) - 1:  # type: ignore[arg-type]
            raise self.fail(node, "its input is not split along its last dimension")
        self.shard(weight, 1)
        graph = self.gm.graph
        w = self.local(weight, node)
        with graph.inserting_before(node):
            out = graph.call_function(F.linear, (x, w))
        tokens = self.sp is not None and self.sp.splits(node)
        out = self.module("reduce", self.ops.reduce(tokens), node)(out)
        if bias is not None:  # on this rank's tokens only: its gradient all-reduced
            b = self.copied(self.whole(bias, node), "bias", node) if tokens else self.whole(bias, node)
            with graph.inserting_before(node):
                out = graph.call_function(operator.add, (out, b))
        out.meta = dict(node.meta)
        if tokens and self.sp is not None:
            self.sp.mark(node, out)
        self.replace(node, out)

    def embedding(self, node: fx.Node) -> None:
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            if not isinstance(mod, nn.Embedding) or mod.max_norm is not None or mod.sparse:
                raise self.fail(node, "only a plain nn.Embedding (no max_norm, not sparse) is split")
            ids, weight, pad = node.args[0], f"{node.target}.weight", mod.padding_idx
        elif node.args and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
            ids, weight = node.args[1], str(node.args[0].target)
            pad = _args(node)[2] if len(_args(node)) > 2 else -1
            pad = None if pad is None or int(pad) < 0 else int(pad)  # type: ignore[arg-type]
        else:
            raise self.fail(node, "only an embedding of the model's own weight is split")
        rows = int(getattr(*self._owner(weight)).shape[0])
        self.shard(weight, 0)
        size = rows // self.t
        tokens = self.sp is not None and self.sp.splits(node)
        lookup = self.module("embedding", self.ops.embedding(self.j * size, size, pad, tokens), node)
        out = lookup(ids, self.local(weight, node))
        out.meta = dict(node.meta)
        if tokens and self.sp is not None:
            self.sp.mark(node, out)
        self.replace(node, out)

    # --- the region --------------------------------------------------------------------------
    def _split_dim(self, node: fx.Node) -> int:
        if "dim" in node.kwargs:
            return int(_kwargs(node)["dim"])
        return int(_args(node)[2]) if len(_args(node)) > 2 else 0

    def region(self, node: fx.Node) -> None:
        """The split dimension of a sharded node's output; sizes it names made local."""
        inputs = [a for a in node.all_input_nodes if a in self.split]
        if not inputs:
            return
        d = self.split[inputs[0]]
        name, out = op_name(node), _shape(node)
        src = _shape(inputs[0])
        if node.op == "call_function" and node.target is operator.getitem and isinstance(_val(inputs[0]), tuple | list):
            self.split[node] = d
        elif name in _VIEWS:
            prefix, k, cum = math.prod(src[:d]), None, 1
            for i, size in enumerate(out):
                if cum == prefix and size != 1:
                    k = i
                    break
                cum *= size
            if k is None:
                raise self.fail(node, "the split dimension does not survive this view")
            self.local_size(node, k)
            self.split[node] = k
        elif name == "expand":
            k = d + len(out) - len(src)
            self.local_size(node, k)
            self.split[node] = k
        elif name in _SPLITS:
            if self._split_dim(node) % len(src) != d:
                self.split[node] = d
                return
            if name == "split":
                self.local_size(node, None)
            elif name != "chunk":
                raise self.fail(node, f"{name} along the split dimension is not followed")
            self.split[node] = d
        elif name in ("transpose", "swapaxes"):
            a, b = (int(x) % len(src) for x in _args(node)[1:3])
            self.split[node] = b if d == a else a if d == b else d
        elif name == "permute":
            args = _args(node)
            dims = [int(x) % len(src) for x in (args[1] if isinstance(args[1], list | tuple) else args[1:])]
            self.split[node] = dims.index(d)
        elif name == "unsqueeze":
            at = int(_args(node)[1]) % len(out)
            self.split[node] = d + 1 if at <= d else d
        elif isinstance(_val(node), Tensor) and len(out) >= len(src) and out[len(out) - len(src):][d] == src[d]:
            self.split[node] = d + len(out) - len(src)  # elementwise, attention, matmul: as their input
        elif isinstance(_val(node), Tensor):
            raise self.fail(node, f"its output {out} does not keep the split dimension of {src}")

    def _is_local(self, size: fx.Node) -> bool:
        """Whether a size node reads a split value's shape (so it is already local)."""
        todo, seen = [size], set()
        while todo:
            n = todo.pop()
            if n in self.split:
                return True
            if n in seen or isinstance(_val(n), Tensor):
                continue
            seen.add(n)
            todo.extend(n.all_input_nodes)
        return False

    def local_size(self, node: fx.Node, k: int | None) -> None:
        """Divide the size argument at ``k`` (a split's size: None) by t where it is global."""
        varargs = not (len(node.args) == 2 and isinstance(node.args[1], list | tuple))
        sizes = list(node.args[1:] if varargs else node.args[1])  # type: ignore[arg-type]
        if node.kwargs.get("split_size") is not None or not sizes:
            raise self.fail(node, "its sizes are not positional")
        at = 0 if k is None else k
        value = sizes[at]
        if isinstance(value, int):
            if value == -1:
                return
            if value % self.t:
                raise self.fail(node, f"tensor_parallel={self.t} does not divide its size {value}")
            sizes[at] = value // self.t
        elif isinstance(value, fx.Node):
            if self._is_local(value):
                return
            with self.gm.graph.inserting_before(node):
                sizes[at] = self.gm.graph.call_function(operator.floordiv, (value, self.t))
        else:
            raise self.fail(node, f"its size {value!r} is not followed")
        args = _args(node)
        node.args = (args[0], *sizes) if varargs else (args[0], type(args[1])(sizes))


def _shape_of(value: Any) -> list[int]:
    return [int(s) for s in value.shape] if isinstance(value, Tensor) else [0]


def shard_stage(stage: fx.GraphModule, roles: dict[str, tuple[str, str]], ops: TensorParallelOps, *,
                vocab: bool, made: dict[int, nn.Parameter], sequence: frozenset[str] = frozenset(),
                last: bool = True) -> None:
    """Rewrite ``stage`` to compute TP rank ``ops.rank``'s part ([Note: tensor parallelism on
    ranks]). ``roles``: each fx node's (role, group) (tracing.tensor_parallel_nodes); ``vocab``:
    whether the degree divides the vocabulary (else it stays replicated); ``made``: the split of
    each original parameter already made on this rank, filled in (ties stay one tensor).
    ``sequence``: the nodes whose values split by tokens (``Structure.tokens``; empty: no
    sequence parallelism, [Note: sequence parallelism on ranks]); ``last``: whether the stage's
    output is the model's (gathered whole) rather than a cut's or a segment's (sent split)."""
    s = _Stage(stage, roles, ops, vocab, made)
    if sequence:
        s.sp = SequenceSplit(s, frozenset(n for n in sequence if vocab or roles.get(n, ("", ""))[0] != VOCAB_EMBEDDING),
                             last)
    for node in list(stage.graph.nodes):
        role = s.roles.get(node)
        if s.sp is not None:  # [Note: sequence parallelism on ranks]
            s.sp.visit(node, role)
        if role in (COLUMN, VOCAB_HEAD):
            s.column(node, head=role == VOCAB_HEAD)
        elif role == ROW:
            s.row(node)
        elif role == VOCAB_EMBEDDING:
            s.embedding(node)
        elif role == SHARDED:
            s.region(node)
    stage.graph.lint()
    stage.recompile()
