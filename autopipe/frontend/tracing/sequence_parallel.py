"""The nodes sequence parallelism splits by tokens: those between the groups, on the tokens' own path.

[Note: sequence nodes] (Korthikanti et al. 2022; [Note: sequence parallelism] in
autopipe/core/tensor_parallel.py says what it costs.) The values a group's row and the vocabulary
embedding make (``(b, s, h)``: their second-to-last dimension is the tokens) reach the next group
through ops that treat each token apart: residual adds, norms over the features, dropout, casts.
Under ``sequence_parallel`` each rank of a TP group runs those on 1/t of the tokens. A node is a
SEQUENCE node when it is outside every group kept, carries an activation (a floating value that
depends on a parameter), reads at least one value of a source (a row, a vocabulary embedding) or
of another sequence node, is one of the ops below, and keeps the tokens as the second-to-last
dimension of an output of at least 3 dimensions, at the same size:

- elementwise ops (arithmetic, activations, casts, dropout, ``contiguous``), whatever else they
  read broadcast over the tokens (a norm's weight) or has them at full size (a position
  embedding: the runtime slices it);
- reductions over the last dimension only, with ``keepdim`` (an RMSNorm's mean of squares);
- ``layer_norm`` / ``rms_norm`` over the last dimension, as functions or as nn.LayerNorm /
  nn.RMSNorm; nn.Dropout and parameter-free activation modules.

Every other op stops it: a column or the head (their input is all-gathered), a view or reshape,
a slice or a pooler's ``[:, 0]``, a reduction over the tokens, a matmul; so the tokens'
dimension is always the second-to-last one of a sequence-split value, and the runtime needs no
more than the node names (autopipe/frontend/building/sequence_parallel.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

__all__ = ["sequence_nodes", "TOKEN_DIM"]

TOKEN_DIM = -2  # the tokens' dimension of every sequence-split value
_ELEMENTWISE = {
    "add", "iadd", "radd", "sub", "rsub", "mul", "imul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt",
    "exp", "log", "tanh", "sigmoid", "relu", "gelu", "silu", "erf", "abs", "square", "reciprocal",
    "clamp", "dropout", "to", "type", "type_as", "float", "half", "bfloat16", "contiguous", "clone",
    "_to_copy", "alias",
}
_LAST_DIM_REDUCTIONS = {"mean", "var", "sum", "amax", "norm", "std"}
_NORMS = {"layer_norm", "rms_norm"}
_MODULES = (nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
_NORM_MODULES = (nn.LayerNorm, nn.RMSNorm) if hasattr(nn, "RMSNorm") else (nn.LayerNorm,)
_FUNCTIONS: dict[Any, str] = {operator.add: "add", operator.iadd: "iadd", operator.sub: "sub", operator.mul: "mul",
              operator.truediv: "truediv", operator.neg: "neg", operator.pow: "pow"}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _tokens(node: fx.Node) -> int | None:
    """The tokens of a node's output (its second-to-last size), None below 3 dimensions."""
    val = _val(node)
    return int(val.shape[TOKEN_DIM]) if isinstance(val, torch.Tensor) and val.dim() >= 3 else None


def _last_dim_only(node: fx.Node, name: str) -> bool:
    """A reduction over the last dimension alone, keeping it (``mean(-1, keepdim=True)``)."""
    args, kwargs = node.args, node.kwargs
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if name == "norm":  # norm(x, p, dim, keepdim)
        dims = kwargs.get("dim", args[2] if len(args) > 2 else None)
        keep = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
    dims = list(dims) if isinstance(dims, list | tuple) else [dims]
    val = _val(node.args[0]) if node.args else None
    rank = val.dim() if isinstance(val, torch.Tensor) else 0
    return bool(keep) and len(dims) == 1 and isinstance(dims[0], int) and rank > 0 and dims[0] % rank == rank - 1


def _norm_of_last_dim(node: fx.Node) -> bool:
    shape = node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else None)
    return isinstance(shape, list | tuple) and len(shape) == 1


def _token_wise(gm: fx.GraphModule, node: fx.Node, op_name: Callable[[fx.Node], str]) -> bool:
    """Whether the op treats each token apart ([Note: sequence nodes]'s list)."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, _NORM_MODULES):
            return len(tuple(mod.normalized_shape)) == 1
        return isinstance(mod, _MODULES)
    if node.op not in ("call_function", "call_method"):
        return False
    name = _FUNCTIONS.get(node.target, "") if node.op == "call_function" else ""
    name = name or (str(node.target) if node.op == "call_method" else op_name(node))
    if name in _ELEMENTWISE:
        return True
    if name in _LAST_DIM_REDUCTIONS:
        return _last_dim_only(node, name)
    return name in _NORMS and _norm_of_last_dim(node)


def sequence_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node], carries: set[fx.Node],
                   grouped: set[fx.Node], sources: Iterable[fx.Node],
                   op_name: Callable[[fx.Node], str]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The sequence nodes ([Note: sequence nodes]) of a graph whose ``nodes`` are in order, and
    every node whose value splits by tokens (those and the sources with a tokens' dimension):
    ``carries`` its activations, ``grouped`` every node of a group kept or of the vocabulary,
    ``sources`` the rows and vocabulary embeddings."""
    split = {s for s in sources if _tokens(s) is not None}
    found: set[fx.Node] = set()
    for node in nodes:
        if node in grouped or node not in carries or node in split:
            continue
        tokens = _tokens(node)
        ins = [i for i in node.all_input_nodes if i in split]
        if tokens is None or not ins or any(_tokens(i) != tokens for i in ins):
            continue
        if _token_wise(gm, node, op_name):
            found.add(node)
            split.add(node)
    return found, split
