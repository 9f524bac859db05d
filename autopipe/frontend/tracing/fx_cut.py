"""Cut a set of nodes out of a traced graph as a GraphModule of its own.

Both a profiled layer (frontend/profiling/harness/replay.py) and a pipeline stage (frontend/building/stages.py) are such a
cut. [Note: a cut reads parameters, never receives them] A ``get_attr`` node the cut reads (its
own parameter, or one tied to a node outside the cut) is re-created inside the cut, on the
original root module: the cut shares the model's parameters and never takes them as inputs.
The graph's ``training`` flag is such a ``get_attr`` too ([Note: train and eval in one graph]
in frontend/tracing/modes.py): each cut reads its own, so ``stage.eval()`` switches that stage.
Every other value from outside becomes a placeholder; graph constants can be substituted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import fx

__all__ = ["GraphCut"]


class GraphCut:
    """A new fx.Graph being filled with copies of nodes of another graph.

    ``inputs`` are the outside values given as placeholders up front, in that order. With
    ``grow_inputs=True`` any other outside value read by a copied node becomes a placeholder
    too (appended to ``inputs`` in order of first use); otherwise reading one is a bug and
    raises KeyError. ``constants`` maps node names to values used in place of the node.
    """

    def __init__(
        self,
        inputs: Sequence[fx.Node] = (),
        *,
        grow_inputs: bool = False,
        constants: Mapping[str, Any] | None = None,
    ) -> None:
        self.graph = fx.Graph()
        self.inputs: list[fx.Node] = []
        self._env: dict[fx.Node, Any] = {}
        self._grow = grow_inputs
        self._constants = dict(constants or {})
        for node in inputs:
            self._add_input(node)

    def _add_input(self, node: fx.Node) -> fx.Node:
        self.inputs.append(node)
        self._env[node] = self.graph.placeholder(node.name)
        return self._env[node]  # type: ignore[no-any-return]

    def lookup(self, node: fx.Node) -> Any:
        """The value of ``node`` inside the cut (see [Note: a cut reads parameters...])."""
        if node in self._env:
            return self._env[node]
        if node.op == "get_attr":
            self._env[node] = self.graph.get_attr(str(node.target))
            return self._env[node]
        if node.name in self._constants:
            return self._constants[node.name]
        if not self._grow:
            raise KeyError(f"{node.name} is read by the cut but is not one of its inputs")
        return self._add_input(node)

    def copy(self, nodes: Iterable[fx.Node]) -> None:
        """Copy ``nodes`` (in topological order) into the cut."""
        for node in nodes:
            self._env[node] = self.graph.node_copy(node, self.lookup)

    def module(self, root: fx.GraphModule, output: Any, class_name: str) -> fx.GraphModule:
        """Finish the cut returning ``output`` (nodes of the original graph, mapped inside)."""
        self.graph.output(fx.map_arg(output, self.lookup))
        self.graph.lint()
        return fx.GraphModule(root, self.graph, class_name=class_name)
