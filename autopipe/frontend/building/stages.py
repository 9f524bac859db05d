"""Plan + traced model -> one nn.Module per pipeline stage.

[Note: stages are a linear chain] Stage i takes the tuple of values live at cut i and returns the
tuple live at cut i + 1 (the last stage returns the model's output). A value made in stage 1 and
used in stage 3 is returned by stage 1, taken and returned unchanged by stage 2, and taken by
stage 3. That single convention lets executor.GPipe and torch.distributed.pipelining run any DAG,
and it is what autopipe.core.cost charges as pass-through bytes at every cut a value crosses.

[Note: stage parameters are the model's] Stage modules are fx GraphModules built over the traced
GraphModule, which references the user's own submodules and parameters; GraphModule copies
attribute *references* under their original qualified names. So optimizer state built on
model.parameters() stays valid, a parameter tied between two stages is one Parameter object used
by both, and, once build() registers them as the model does ([Note: a stage saves what the model
saves]), stage.state_dict() keys are the original model's keys.

[Note: a stage writes a copy of its input] A stage whose first op writes one of its inputs in
place (a cut just before cnn's ``ReLU(inplace=True)``) gets a copy of that input to write. A
received input is a leaf that needs a gradient wherever a runtime made it one (a recomputed
micro-batch's kept input, a PipelineStage's receive buffer), and autograd refuses to write a leaf
in place; and a checkpointed micro-batch keeps its input to recompute from, which the write
would change before the recomputation reads it. In the whole model the op writes a tensor its
producer made, which nobody keeps, so the copy is the only change. A write is a module with
``inplace=True``, a method or function whose name ends in ``_``, an aten op whose schema writes
its first argument, an augmented assignment or an item assignment, on the input itself or on a
view of it (``x.t().add_(1)``: the view methods and functions, and aten ops whose schema returns
an alias, followed to any depth; a ``reshape`` that copies is taken for a view, so such an input
is copied without need).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, fx, nn
from torch.utils.checkpoint import checkpoint

from autopipe.core.plan_fit import assign_stages
from autopipe.core.recomputed_layers import segments
from autopipe.errors import BuildError, first_line
from autopipe.frontend.tracing.fx_cut import GraphCut
from autopipe.frontend.tracing.graph import LayerGraph
from executor._torch_compat import tree_unflatten

if TYPE_CHECKING:
    from autopipe.core.plan import Plan

__all__ = ["RecomputedLayer", "build", "recompute_alone", "split_stages", "stage_boundaries"]


def _check_stages(graph: LayerGraph, stages: Sequence[Sequence[str]]) -> dict[str, int]:
    edges = [(u, v, 0) for u, v in graph.nx.edges]
    return assign_stages(stages, graph.layers, edges, "the traced model", error=BuildError)


def stage_boundaries(
    graph: LayerGraph, stages: Sequence[Sequence[str]]
) -> tuple[dict[str, int], list[list[str]]]:
    """Node -> stage, and the fx value names live at each cut (cut 0 = the model's inputs)."""
    layer_stage = _check_stages(graph, stages)
    k = len(stages)
    node_stage = {n: layer_stage[layer] for n, layer in graph.node_layer.items()}
    args = graph.input_names[: graph.num_args]
    live: list[list[str]] = [list(args)] + [[] for _ in range(k - 1)]
    for node in graph.gm.graph.nodes:
        if node.op in ("output", "get_attr") or (
            node.op == "placeholder" and node.name not in args
        ):
            continue
        made = -1 if node.op == "placeholder" else node_stage[node.name]
        last = max(
            (k if u.op == "output" else node_stage[u.name] for u in node.users), default=made
        )
        for cut in range(max(made + 1, 1), min(last, k - 1) + 1):
            live[cut].append(node.name)
    return node_stage, live


def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_module" and str(node.target) == "_guards_fn"


def split_stages(graph: LayerGraph, stages: Sequence[Sequence[str]]) -> list[fx.GraphModule]:
    """Cut ``graph.gm`` into ``len(stages)`` GraphModules following the linear-chain rule."""
    node_stage, live = stage_boundaries(graph, stages)
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    constants = {
        name: by_name[name].meta.get("val") for name in graph.input_names[graph.num_args :]
    }
    out_node = next(n for n in graph.gm.graph.nodes if n.op == "output")
    codegen = getattr(graph.gm.graph, "_codegen", None)
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    k = len(stages)
    modules: list[fx.GraphModule] = []
    for i in range(k):
        cut = GraphCut([by_name[name] for name in live[i]], constants=constants)
        cut.copy(node for node in graph.gm.graph.nodes
                 if node.op not in ("placeholder", "output", "get_attr") and not _is_guard(node)
                 and node_stage[node.name] == i)
        output = tuple(by_name[name] for name in live[i + 1]) if i < k - 1 else out_node.args[0]
        module = cut.module(graph.gm, output, f"Stage{i}")
        if i == k - 1 and out_spec is not None:
            module.register_forward_hook(_Unflatten(out_spec))
        modules.append(module)
    return modules


class _Unflatten:
    """Forward hook: torch.export graphs return a flat list; rebuild the model's output type
    (e.g. a HuggingFace ModelOutput) from the graph's pytree spec."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        return tree_unflatten(list(output), self.spec)


def build(model: nn.Module, plan: Plan, graph: LayerGraph) -> list[fx.GraphModule]:
    """Split ``model`` (traced as ``graph``) into the plan's stages.

    Raises:
        PlanError: the plan was made for another model or batch shape (fingerprint).
        BuildError: the plan's stages do not fit the graph.
    """
    plan.check(graph.layers, graph.fingerprint)
    registry = _Registry(model)
    stages = split_stages(graph, plan.stages)
    foreign = [n for s in stages for n, p in s.named_parameters() if id(p) not in registry.names]
    if foreign:
        raise BuildError(
            f"stage parameters {foreign[:3]} are not the model's own; trace this model "
            "(autopipe.trace(model, ...)) and build with that graph"
        )
    for i, stage in enumerate(stages):
        registry.apply(stage, i)
        _free_dtype_checks(stage)
        _copy_written_inputs(stage)
    order = {name: i for i, name in enumerate(graph.layers)}
    recomputed, starts = set(plan.recompute_layers), {order[n] for n in plan.segment_starts}
    for stage, names in zip(stages, plan.stages, strict=True):  # [Note: recomputed layers]
        mine = [order[n] for n in names if n in recomputed]
        for run in segments(mine, [0] * len(order), starts):
            layers = {graph.layers[i] for i in run}
            recompute_alone(stage, [n for n, owner in graph.node_layer.items() if owner in layers],
                            f"{graph.layers[run[0]]}..{graph.layers[run[-1]]}")
    return stages


def _free_dtype_checks(stage: fx.GraphModule) -> None:
    """[Note: a stage's dtypes follow autocast] torch.export puts an ``_assert_tensor_metadata``
    before each ``.to(...)`` of the model, holding the dtype the tensor had when traced (fp32).
    A stage runs under autocast (``precision=``, or the caller's own ``with torch.autocast``)
    and with FSDP2 parameters gathered in bf16 (executor/ranks/replicated.py), where the same tensor
    may be bf16, and the plain model runs on. So the stages keep these checks' device and
    layout but not their dtype: in the stage's graph and in the graphs nested in it, where
    torch 2.11's export puts a region the model runs under its own autocast (HF Llama's rotary
    embedding: a ``wrap_with_autocast`` submodule)."""
    for graph in [m for m in stage.modules() if isinstance(m, fx.GraphModule)]:
        changed = False
        for node in graph.graph.nodes:
            if (node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
                    and node.kwargs.get("dtype") is not None):
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
                changed = True
        if changed:
            graph.recompile()


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
             operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
             operator.irshift, operator.imatmul, operator.setitem}


def _writes_first_argument(node: fx.Node, stage: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return getattr(stage.get_submodule(str(node.target)), "inplace", False) is True
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE or node.kwargs.get("inplace") is True:
        return True
    schema = getattr(node.target, "_schema", None)  # an aten op: does it write its self?
    if schema is not None:
        alias = schema.arguments[0].alias_info if schema.arguments else None
        return bool(alias is not None and alias.is_write)
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "unsqueeze",
                 "squeeze", "expand", "expand_as", "narrow", "select", "split", "chunk", "unbind", "flatten",
                 "unflatten", "__getitem__", "detach", "as_strided", "diagonal", "movedim", "swapaxes",
                 "swapdims", "unfold", "contiguous"}
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.narrow, torch.select, torch.squeeze, torch.unsqueeze,
                   torch.flatten, torch.split, torch.chunk, torch.permute, torch.reshape, torch.unbind,
                   torch.movedim, torch.swapaxes, torch.diagonal, torch.t, torch.detach}


def _may_alias_first_argument(node: fx.Node) -> bool:
    """Whether ``node``'s result may be a view of its first argument (a write to it then writes
    that argument): a view method or function, or an aten op whose schema returns an alias."""
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target in _VIEW_FUNCTIONS:
        return True
    schema = getattr(node.target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return bool(alias is not None and not alias.is_write)


def _written(value: fx.Node, stage: fx.GraphModule) -> bool:
    """Whether the stage writes ``value`` in place, itself or through a view of it."""
    todo, seen = [value], {value}
    while todo:
        node = todo.pop()
        for user in node.users:
            if not user.args or user.args[0] is not node:
                continue
            if _writes_first_argument(user, stage):
                return True
            if _may_alias_first_argument(user) and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _copy_written_inputs(stage: fx.GraphModule) -> None:
    """[Note: a stage writes a copy of its input]"""
    graph = stage.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    written = [p for p in inputs if _written(p, stage)]
    if not written:
        return
    for p in written:
        with graph.inserting_after(inputs[-1]):
            copy = graph.call_method("clone", (p,))
        p.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
    stage.recompile()


class RecomputedLayer(nn.Module):
    """A segment of a stage (consecutive layers), its saves dropped after the forward and
    recomputed in the backward ([Note: recomputed layers] in autopipe/core/recomputed_layers.py)."""

    def __init__(self, layer: fx.GraphModule) -> None:
        super().__init__()
        self.layer = layer
        # its tensors are the stage's own, under the model's names ([Note: a stage saves what the
        # model saves]): registered here too (so .to(), materializing and FSDP2 reach every user
        # of one), but neither saved nor expected again under this module's names
        self.register_state_dict_post_hook(_unsaved)
        self.register_load_state_dict_pre_hook(_not_loaded)

    def forward(self, *args: Any) -> Any:
        # the layers run on a copy of their inputs, as one may write its input in place (cnn's
        # in-place ReLU: the recompute then failed); and the checkpoint keeps a copy of its own,
        # so that a later in-place op on an original cannot change what the backward recomputes
        # from. The kept copy is what the cost model charges ([Note: recomputed layers]).
        # torch's reentrant recompute: a forward without autograd, recomputed with it, as
        # executor.GPipe's own (what the profile's recompute ratio measures); the non-reentrant
        # one hooks every saved tensor in Python, which the profile does not measure. It needs an
        # input with a gradient to reach the parameters inside, which a segment on the raw batch
        # (an image, token ids) lacks: the anchor is one. (What each measured: CHANGELOG.md,
        # "Recomputed segments fed by the caller's batch use the reentrant checkpoint".)
        if not torch.is_grad_enabled():  # nothing is saved, nothing recomputed
            return self.layer(*args)
        return checkpoint(self._run, _anchor(), *_copies(args), use_reentrant=True)

    def _run(self, anchor: Tensor, *args: Any) -> Any:
        return self.layer(*_copies(args))


def _unsaved(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(f"{prefix}layer.")]:
        del state_dict[key]


def _not_loaded(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """Each tensor loads itself under these names (a no-op): it is loaded under the model's."""
    layer = module.get_submodule("layer")
    for key, tensor in layer.state_dict(prefix=f"{prefix}layer.", keep_vars=True).items():
        state_dict.setdefault(key, tensor.detach())


def _anchor() -> Tensor:
    """An empty tensor that needs a gradient: with it among its inputs, torch's reentrant
    checkpoint reaches the segment's parameters even when no input of the segment needs a
    gradient (a segment fed by the caller's batch)."""
    return torch.empty(0, requires_grad=True)


def _copies(args: tuple[Any, ...]) -> list[Any]:
    return [a.clone() if isinstance(a, Tensor) else a for a in args]


def recompute_alone(stage: fx.GraphModule, node_names: Sequence[str], label: str) -> None:
    """Replace the nodes of a segment (an interval of ``stage``'s graph) by one call of a
    :class:`RecomputedLayer` holding them; the stage computes the same values."""
    names = set(node_names)
    nodes = [n for n in stage.graph.nodes if n.name in names and n.op not in ("placeholder", "output", "get_attr")]
    if not nodes:
        return
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    cut = GraphCut(grow_inputs=True)
    cut.copy(nodes)
    target = f"recomputed_{len([m for m in stage.children() if isinstance(m, RecomputedLayer)])}"
    stage.add_submodule(target, RecomputedLayer(cut.module(stage, tuple(outputs), "RecomputedSegment")))
    with stage.graph.inserting_after(nodes[-1]):
        call = stage.graph.call_module(target, tuple(cut.inputs))
    with stage.graph.inserting_after(call):
        for j, out in enumerate(outputs):
            # a name of its own, not fx's next free getitem_N: that may be another node's name in
            # the traced model, which the tensor-parallel roles are keyed by
            item = stage.graph.create_node("call_function", operator.getitem, (call, j), name=f"{target}_out_{j}")
            out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        stage.graph.erase_node(node)
    try:
        stage.graph.lint()
    except RuntimeError as err:  # a node between its layers reads it: not one interval
        raise BuildError(f"layers {label} cannot be recomputed as one segment ({first_line(err)}); "
                         "leave them out of the plan's recompute_layers") from None
    stage.recompile()


class _Registry:
    """How ``model`` registers its tensors: every name of each, and which names it saves.

    [Note: a stage saves what the model saves] fx.GraphModule copies each ``get_attr`` target
    onto fresh ``nn.Module()``s and registers every tensor that is not a Parameter as a
    *persistent* buffer, so a stage would save what the model does not: buffers registered with
    ``persistent=False`` (Llama's rotary ``inv_freq``, BERT's ``position_ids``) and plain
    tensor attributes torch.export lifts as constants; and torch.export keeps one name per tied
    tensor (GPT-2's ``lm_head.weight`` next to ``transformer.wte.weight``). :meth:`apply`
    re-registers every tensor a stage holds the way the model does: under each of the model's
    names for it, as a parameter, as a buffer that is persistent exactly where
    ``model.state_dict()`` has that key, and under any other name (a constant) as a
    non-persistent buffer, which still moves with the stage. The stages' state_dicts are then
    the model's, key for key (executor/local/gpipe.py [Note: state_dict keys] joins them), and load
    both ways with ``strict=True``. The model's own modules (fx ``call_module`` leaves the stage
    shares) are registered that way already and are never changed.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names: dict[int, list[str]] = {}
        for name, tensor in [*model.named_parameters(remove_duplicate=False),
                             *model.named_buffers(remove_duplicate=False)]:
            self.names.setdefault(id(tensor), []).append(name)
        self.saved = set(model.state_dict(keep_vars=True))
        self.own = {id(m) for m in model.modules()}

    def apply(self, stage: nn.Module, index: int) -> None:
        held = [*stage.named_parameters(remove_duplicate=False),
                *stage.named_buffers(remove_duplicate=False)]
        for name, tensor in held:
            names = self.names.get(id(tensor), [])
            for alias in names:
                self._put(stage, alias, tensor, persistent=alias in self.saved)
            if name not in names:
                self._put(stage, name, tensor, persistent=False)
        extra = [key for key in stage.state_dict(keep_vars=True) if key not in self.saved]
        if extra:  # a Parameter under a name the model does not have for it
            raise BuildError(
                f"stage {index} would save {extra[:3]}, which model.state_dict() does not have; "
                "trace this model (autopipe.trace(model, ...)) and build with that graph"
            )

    def _put(self, stage: nn.Module, name: str, tensor: Tensor, *, persistent: bool) -> None:
        *path, leaf = name.split(".")
        parent = stage
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        if id(parent) in self.own:
            return
        if isinstance(tensor, nn.Parameter):
            parent._buffers.pop(leaf, None)
            parent.register_parameter(leaf, tensor)
        else:
            parent._parameters.pop(leaf, None)
            parent.register_buffer(leaf, tensor, persistent=persistent)
