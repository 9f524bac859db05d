"""Sequence parallelism in one rank's stage: the values between groups split by tokens.

[Note: sequence parallelism on ranks] With ``shard_stage(..., sequence=names)`` (the fx nodes
whose values split by tokens: each sequence node of [Note: sequence nodes] and each row and
vocabulary embedding with a tokens' dimension), TP rank j of t holds tokens j of t (their
dimension is always the second-to-last) of each such value, Korthikanti et al. 2022's way:

- a row's all-reduce is a reduce-scatter of the tokens (its gradient all-gathered), the
  vocabulary embedding's too; a row's bias is added to rank j's tokens, its read through
  ``ops.copy()`` (the gradient of rank j's tokens all-reduced);
- a column's and the head's f all-gathers a split input (its gradient reduce-scattered);
- a sequence node runs on rank j's tokens: a whole value it reads with the tokens at full size
  (a position embedding, a vocabulary left replicated) is sliced to rank j's (its gradient
  all-gathered, so the replicated layers before it see the whole gradient), and every other
  tensor it reads (a norm's weight and bias, broadcast over the tokens) passes ``ops.copy()``
  (each rank's gradient is of its tokens only: all-reduced); nn.LayerNorm / nn.RMSNorm modules
  become their functions on the weights read so;
- any other reader of a split value (a replicated op, the model's output on the last stage)
  reads it all-gathered (its gradient: rank j's slice), except a read of its shape, which is
  the whole value's, and a read of its dtype or device;
- a cut carries split values split (TP rank j to TP rank j: executor's ``Wire.parts``), and a
  segment of layers recomputed alone takes and returns them as its stage does.

A token count t does not divide is refused in one line: at build time on the example, at a step
by the wires of the cuts and the collectives.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import Size, Tensor, fx, nn

from autopipe.core.tensor_parallel import COLUMN, ROW, SEQUENCE, VOCAB_EMBEDDING, VOCAB_HEAD
from autopipe.frontend.building.stages import RecomputedLayer
from autopipe.frontend.tracing.sequence_parallel import TOKEN_DIM
from autopipe.frontend.tracing.tensor_parallel import op_name

if TYPE_CHECKING:
    from autopipe.frontend.building.tensor_parallel import _Stage

__all__ = ["SequenceSplit", "whole_shape", "whole_size"]

_METADATA = {"dim", "dtype", "device", "ndim", "is_floating_point", "_assert_tensor_metadata", "requires_grad"}
_SIZES = {"size", "sym_size"}


def whole_shape(x: Tensor, degree: int) -> Size:
    """The shape of the whole value of which ``x`` holds 1/``degree`` of the tokens."""
    shape = list(x.shape)
    shape[TOKEN_DIM] *= degree
    return Size(shape)


def whole_size(x: Tensor, dim: int | None, degree: int) -> Any:
    shape = whole_shape(x, degree)
    return shape if dim is None else shape[dim]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


class SequenceSplit:
    """The values of one stage being rewritten that hold rank j's tokens, and the rewrite's steps."""

    def __init__(self, stage: _Stage, names: frozenset[str], last: bool) -> None:
        self.s, self.names, self.last = stage, names, last
        self.values: set[fx.Node] = set()
        self.whole: dict[fx.Node, fx.Node] = {}
        self.sliced: dict[fx.Node, fx.Node] = {}

    def splits(self, node: fx.Node) -> bool:
        """Whether this node's value is split by tokens (by its traced name)."""
        return node.name in self.names

    def mark(self, old: fx.Node, new: fx.Node) -> None:
        """``new`` (``old``'s rewrite) holds rank j's tokens (the caller checked that t divides
        them: autopipe.assemble.tensor_parallel.roles_of)."""
        self.values.add(new)

    def visit(self, node: fx.Node, role: str | None) -> None:
        """``node``'s part before its role's rewrite (the stage's nodes in order)."""
        if node.op == "placeholder":
            if self.splits(node):
                self.mark(node, node)
        elif role == SEQUENCE:
            self.sequence(node)
        elif role not in (COLUMN, VOCAB_HEAD, ROW, VOCAB_EMBEDDING):
            self.reader(node)
            self.segment_output(node)

    def segment_output(self, node: fx.Node) -> None:
        """``recomputed_K_out_j``: split where the segment's output j is."""
        call = node.args[0] if node.target is operator.getitem else None
        if not (isinstance(call, fx.Node) and call.op == "call_module"):
            return
        mod = self.s.gm.get_submodule(str(call.target))
        if not isinstance(mod, RecomputedLayer):
            return
        out = next(n for n in mod.layer.graph.nodes if n.op == "output").args[0]
        value = out[node.args[1]] if isinstance(out, tuple | list) else out  # type: ignore[index]
        if isinstance(value, fx.Node) and value.name in self.names:
            self.mark(value, node)

    # --- a sequence node ---------------------------------------------------------------------
    def sequence(self, node: fx.Node) -> None:
        """A sequence node on rank j's tokens: whole inputs sliced, the rest through copy()."""
        if node.op == "call_module":
            node = self._functional_norm(node)
        tokens = _val(node).shape[TOKEN_DIM]
        for value in list(node.all_input_nodes):
            if value in self.values:
                continue
            val = _val(value) if value.op != "get_attr" else operator.attrgetter(str(value.target))(self.s.gm)
            if not isinstance(val, Tensor) or not val.is_floating_point():
                continue
            if val.dim() >= 2 and val.shape[TOKEN_DIM] == tokens and tokens > 1:
                node.replace_input_with(value, self._slice(value))
            else:
                node.replace_input_with(value, self.s.copied(value, "sequence", node))
        self.mark(node, node)

    def _slice(self, value: fx.Node) -> fx.Node:
        if value not in self.sliced:  # before its first reader: the node being rewritten
            before = next(u for u in self.s.gm.graph.nodes if u in value.users)
            self.sliced[value] = self.s.module("slice_tokens", self.s.ops.slice_tokens(), before)(value)
        return self.sliced[value]

    def _functional_norm(self, node: fx.Node) -> fx.Node:
        """nn.LayerNorm / nn.RMSNorm as its function of the weights read (so they can pass copy())."""
        mod = self.s.gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Dropout | nn.GELU | nn.ReLU | nn.SiLU | nn.Tanh | nn.Sigmoid | nn.Identity):
            return node
        weight = None if getattr(mod, "weight", None) is None else self.s.whole(f"{node.target}.weight", node)
        shape = tuple(mod.normalized_shape)  # type: ignore[arg-type]
        with self.s.gm.graph.inserting_before(node):
            if isinstance(mod, nn.LayerNorm):
                bias = None if mod.bias is None else self.s.whole(f"{node.target}.bias", node)
                new = self.s.gm.graph.call_function(F.layer_norm, (node.args[0], shape, weight, bias, mod.eps))
            else:
                eps: Any = mod.eps  # RMSNorm's may be None: the dtype's
                new = self.s.gm.graph.call_function(F.rms_norm, (node.args[0], shape, weight, eps))
        new.meta = dict(node.meta)
        self.s.replace(node, new)
        return new

    # --- every other reader ------------------------------------------------------------------
    def reader(self, node: fx.Node) -> None:
        """A node that is no sequence node, column or head, reading split values."""
        split = [v for v in node.all_input_nodes if v in self.values]
        if not split:
            return
        name = op_name(node) if node.op == "call_function" else str(node.target)
        if node.op == "output" and not self.last:
            return  # crosses the cut split
        if node.op == "call_module" and isinstance(self.s.gm.get_submodule(str(node.target)), RecomputedLayer):
            return  # the segment takes them split
        if node.op == "call_function" and node.target is getattr:
            attr = node.args[1]
            if attr == "shape":
                self._resize(node, (node.args[0], self.s.t), whole_shape)
            elif attr not in _METADATA:
                raise self.s.fail(node, f"reads {attr!r} of a value split by tokens")
            return
        if name in _SIZES:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            self._resize(node, (node.args[0], dim, self.s.t), whole_size)
            return
        if name in _METADATA:
            return
        for value in split:
            node.replace_input_with(value, self._whole(value))

    def _resize(self, node: fx.Node, args: tuple[Any, ...], fn: Any) -> None:
        with self.s.gm.graph.inserting_before(node):
            new = self.s.gm.graph.call_function(fn, args)
        new.meta = dict(node.meta)
        self.s.replace(node, new)

    def _whole(self, value: fx.Node) -> fx.Node:
        if value not in self.whole:
            before = next(u for u in self.s.gm.graph.nodes if u in value.users)
            self.whole[value] = self.s.module("whole_tokens", self.s.ops.whole_tokens(), before)(value)
            self.whole[value].meta = dict(value.meta)
        return self.whole[value]
