"""Each layer's share of the whole graph's forward and backward, stamped while it runs in sequence.

[Note: layer shares in sequence] A layer timed alone runs on warm caches; in the pipeline it runs
right after its neighbours, and what that costs differs from layer to layer: a convolution at full
resolution streams activations far larger than the cache, a small matmul does not. One scale for
the whole graph ([Note: layers in sequence] in in_sequence.py) keeps the sum right but not the
split: the bundled U-Net's first 12 of 17 layers took 42% of the backward timed alone and 46-47%
run as a stage, so that stage's backward ran 11% over its prediction (stamped: 46%). So the
profiler also runs a copy of the traced graph with a stamp around every layer and a gradient
hook on every layer's output:

- forward: layer ``i`` owns the time from the stamp before its first node to the stamp after its
  last one (registering the hook below comes after that, in no layer's time);
- backward: a hook fires when the gradient of layer ``i``'s output is complete, i.e. when layer
  ``i``'s backward can start; layer ``i`` owns the time from its hook to the next stamp, the last
  one at the end of the backward. Autograd runs the ready node created last, so in a chain the
  layers' backwards run one after another, last layer first; where branches meet (a skip
  connection) another branch's layer may run inside the span, which moves time between
  neighbours, never out of the sum.

:func:`layer_shares` turns the stamps into each layer's fraction of the total; the profiler
multiplies them by the uninstrumented whole-graph time, so the stamps' own cost (a Python call
each, about a microsecond) moves the split a little and the sum not at all. On CUDA the stamps
are events on the current stream (autograd's worker runs on the forward's stream), read after
one synchronisation. On a CPU the stamps read the profile's own clock (``clock``: the profile
timer's, ``time.perf_counter`` unless it counts another time), so the shares and the times they
split are of one kind.
"""

from __future__ import annotations

import copy
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from autopipe.frontend.profiling.harness.under_autocast import autocast_call
from executor._torch_compat import tree_leaves

__all__ = ["LayerStamps", "layer_shares"]

Stamp = tuple[int, float | torch.cuda.Event]  # (layer index or -1, time or event)


def layer_shares(stamps: Sequence[tuple[int, float]], layers: int) -> list[float]:
    """Each layer's fraction of the time between the first and the last stamp.

    ``stamps`` are ``(layer index, ms)`` in time order; index -1 marks a start or an end that
    belongs to no layer. The interval from a stamp to the next belongs to the first one's layer.
    All zeros when nothing was timed (the caller keeps its uniform scale then).
    """
    owned = [0.0] * layers
    for (layer, start), (_, end) in itertools.pairwise(stamps):
        if layer >= 0:
            owned[layer] += max(0.0, end - start)
    total = sum(owned)
    return [t / total for t in owned] if total > 0 else owned


class LayerStamps:
    """A stamped copy of a flat GraphModule (see [Note: layer shares in sequence]).

    ``run(*args)`` runs one forward and backward and keeps its stamps; :meth:`shares` gives the
    per-layer fractions of both, as medians over the runs. ``clock``: seconds, read for every
    stamp on a CPU (CUDA stamps are events).
    """

    def __init__(self, gm: fx.GraphModule, node_layer: Mapping[str, str], layers: Sequence[str],
                 device: torch.device, precision: str = "fp32",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.layers = list(layers)
        self.clock = clock
        self.precision, self.device = precision, device
        self._cuda = device.type == "cuda"
        self._fwd: list[Stamp] = []
        self._bwd: list[Stamp] = []
        self._runs: list[tuple[list[float], list[float]]] = []
        self._handles: list[Any] = []  # this run's gradient hooks, removed when it ends
        self.module = self._stamped(gm, node_layer)

    def _now(self) -> float | torch.cuda.Event:
        if not self._cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _mark(self, layer: int) -> None:
        self._fwd.append((layer, self._now()))

    def _hook(self, layer: int, value: Any) -> Any:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # a layer may return a leaf (a parameter it only casts): its hook must not outlive
                # the run, or every later backward of the user's model fires it
                self._handles.append(t.register_hook(lambda _grad, i=layer: self._bwd.append((i, self._now()))))
        return value

    def _stamped(self, gm: fx.GraphModule, node_layer: Mapping[str, str]) -> fx.GraphModule:
        graph = copy.deepcopy(gm.graph)
        index = {name: i for i, name in enumerate(self.layers)}
        started: set[str] = set()
        last: dict[str, fx.Node] = {}
        for node in list(graph.nodes):
            layer = node_layer.get(node.name)
            if layer not in index:
                if node.op == "output":
                    with graph.inserting_before(node):
                        graph.call_function(self._mark, (-1,))
                continue
            if layer not in started:
                started.add(layer)
                with graph.inserting_before(node):
                    graph.call_function(self._mark, (index[layer],))
            last[layer] = node
        for layer, node in last.items():
            with graph.inserting_after(node):  # the end of the layer, then the hook's own cost
                end = graph.call_function(self._mark, (-1,))
            with graph.inserting_after(end):
                hooked = graph.call_function(self._hook, (index[layer], node))
            node.replace_all_uses_with(hooked, delete_user_cb=functools.partial(_other_than, hooked))
        stamped = fx.GraphModule(gm, graph, "StampedGraph")
        stamped.training = gm.training
        return stamped

    def _ms(self, stamps: list[Stamp]) -> list[tuple[int, float]]:
        if not self._cuda:
            return [(i, t * 1e3) for i, t in stamps if isinstance(t, float)]
        torch.cuda.synchronize()
        events = [(i, e) for i, e in stamps if isinstance(e, torch.cuda.Event)]
        return [(i, float(events[0][1].elapsed_time(e))) for i, e in events]

    def run(self, *args: Any, keep: bool = True) -> None:
        """One stamped forward and backward (all-ones output gradients); its shares are kept
        unless ``keep`` is false (a warmup run)."""
        self._fwd, self._bwd = [], []
        try:
            out = autocast_call(self.module, self.precision, self.device)(*args)  # [Note: profiling under a precision]
            roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                self._bwd.append((-1, self._now()))
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                self._bwd.append((-1, self._now()))
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if not keep:
            return
        fwd = self._ms(self._fwd)
        bwd = sorted(self._ms(self._bwd), key=lambda s: s[1]) if roots else []
        self._runs.append((layer_shares(fwd, len(self.layers)), layer_shares(bwd, len(self.layers))))

    def shares(self) -> tuple[list[float], list[float]]:
        """Per-layer forward and backward fractions: each the median over the runs, renormalised."""
        return _median_shares([f for f, _ in self._runs]), _median_shares([b for _, b in self._runs])


def _other_than(node: fx.Node, user: fx.Node) -> bool:
    return user is not node


def _median_shares(runs: list[list[float]]) -> list[float]:
    if not runs:
        return []
    per_layer = [statistics.median(col) for col in zip(*runs, strict=True)]
    total = sum(per_layer)
    return [s / total for s in per_layer] if total > 0 else per_layer
