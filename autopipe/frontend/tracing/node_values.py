"""Every node's output value, recorded once a graph is captured: node.meta['val'].

A fake run of the captured GraphModule on the example inputs ([Note: two tracers, one contract]
in capture.py): each node's output is a FakeTensor of the example's sizes, no real activation
allocated. Where an op has no fake kernel the graph runs once for real under no_grad and keeps
meta tensors of what it saw; a graph that does not run on the inputs at all raises
:class:`GraphRunError`, with the user's line of the node it stopped at.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autopipe.frontend.tracing.diagnose import user_line_in
from executor._torch_compat import FakeTensorMode, tree_map_only

__all__ = ["GraphRunError", "record_values"]


class GraphRunError(Exception):
    """The traced graph failed on the example inputs: the error and the user's line of the node."""

    def __init__(self, err: Exception, line: str) -> None:
        super().__init__(str(err))
        self.err, self.line = err, line


def record_values(gm: fx.GraphModule, args: tuple[Any, ...]) -> FakeTensorMode | None:
    """Store every node's output as a fake tensor in node.meta['val'] (no real activations); the
    mode it ran under, or None where the graph needed one real forward instead."""
    class _MetaRecorder(fx.Interpreter):
        current: fx.Node | None = None

        def run_node(self, n: fx.Node) -> Any:
            self.current = n
            result = super().run_node(n)
            n.meta["val"] = result
            return result

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        with mode:
            _MetaRecorder(gm).run(*fake_args)
        return mode
    except Exception:  # an op without a fake kernel: fall back to one real forward
        pass
    recorder = _MetaRecorder(gm)
    try:
        with torch.no_grad():
            recorder.run(*args)
    except Exception as err:
        node = recorder.current
        raise GraphRunError(err, user_line_in(node.meta.get("stack_trace") if node else None)) from err
    for n in gm.graph.nodes:
        n.meta["val"] = tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), n.meta["val"]
        )
    return None
