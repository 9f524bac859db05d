"""Plan + traced model -> one nn.Module per pipeline stage.

[Note: stages are a linear chain] Stage i takes the tuple of values live at cut i and returns the
tuple live at cut i + 1 (the last stage returns the model's output). A value made in stage 1 and
used in stage 3 is returned by stage 1, taken and returned unchanged by stage 2, and taken by
stage 3. That single convention lets executor.GPipe and torch.distributed.pipelining run any DAG,
and it is what autopipe.core.cost charges as pass-through bytes at every cut a value crosses.

[Note: stage parameters are the model's] Stage modules are fx GraphModules built over the traced
GraphModule, which references the user's own submodules and parameters; GraphModule copies
attribute *references* under their original qualified names. So stage.state_dict() keys are the
original model's keys, optimizer state built on model.parameters() stays valid, and a parameter
tied between two stages is one Parameter object used by both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from autopipe.core.plan import assign_stages
from autopipe.errors import BuildError
from autopipe.frontend.fx_cut import GraphCut
from autopipe.frontend.graph import LayerGraph
from executor._torch_compat import tree_unflatten

if TYPE_CHECKING:
    from autopipe.core.plan import Plan

__all__ = ["build", "split_stages", "stage_boundaries"]


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
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    stages = split_stages(graph, plan.stages)
    foreign = [n for s in stages for n, p in s.named_parameters() if id(p) not in names]
    if foreign:
        raise BuildError(
            f"stage parameters {foreign[:3]} are not the model's own; trace this model "
            "(autopipe.trace(model, ...)) and build with that graph"
        )
    for stage in stages:
        _add_aliases(stage, names)
    return stages


def _add_aliases(stage: nn.Module, names: dict[int, list[str]]) -> None:
    """Register every other name of a tied tensor the stage holds (e.g. a HF model's
    ``lm_head.weight`` next to ``transformer.wte.weight``), so the stage's state_dict has the
    plain model's keys: torch.export keeps only one name per tied tensor."""
    held = [*stage.named_parameters(remove_duplicate=False),
            *stage.named_buffers(remove_duplicate=False)]
    present = {name for name, _ in held}
    for _, tensor in held:
        for alias in names.get(id(tensor), []):
            if alias in present:
                continue
            parent: nn.Module = stage
            *path, leaf = alias.split(".")
            for part in path:
                child = getattr(parent, part, None)
                if not isinstance(child, nn.Module):
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            if isinstance(tensor, nn.Parameter):
                parent.register_parameter(leaf, tensor)
            else:
                parent.register_buffer(leaf, tensor)
            present.add(alias)

