"""A layer's backward split as the zero-bubble schedules run it: input gradients, then weights.

[Note: split backward measured] ([Note: split backward] in autopipe/core/zero_bubble.py is what
the schedules do with it) After a layer's timed repeats, one more forward and its backward in
torch's two halves, each timed: torch.distributed.pipelining's own ``stage_backward_input``
(``autograd.grad`` with ``inputs=`` the layer's inputs, the graph retained, the gradients that
reach the weights' nodes kept) and ``stage_backward_weight`` (``autograd.grad`` from those to
the parameters), as PipelineStage calls them (through executor/_torch_compat/). A layer
whose inputs need no gradient (token ids) has no first half: torch's first stage then runs the
whole backward in the second (``backward_weight_one_chunk``), and so is this layer timed. What
the first half leaves for the second beyond the retained activations is
``weight_grad_bytes``: the kept gradients (each tensor once). Each half's time less what that
half takes on a layer of one 1-element weight (``split_overhead``, the median of
``CALIBRATION_REPEATS``, as [Note: harness overhead] in layer_timing.py calibrates the whole
backward: each half is an engine run of its own, and torch walks the graph in Python for the
first) gives the layer's input share of its backward; the profile's
``bwd_input_ms`` / ``bwd_weight_ms`` are that share of its ``bwd_ms`` (the median of the timed
repeats, scaled to the graph in sequence where it is), so the two sum to it, and
``meta["bwd_split_ratio"]`` records what the two halves took over what the backward did, summed
over the measured layers (a split backward costs more than a whole one: two engine runs, torch's
walk over the graph). One sample per layer: the split costs a forward and a backward more per
measured layer, nothing per repeat. Where torch's halves are not the ones autopipe knows
(``split_backward_api``) the profile has no split, and the planner refuses the zero-bubble
schedules for it in one line.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autopipe.frontend.profiling.harness.layer_timing import (
    CALIBRATION_REPEATS,
    backward_roots,
    fresh,
    storage_key,
)
from autopipe.frontend.profiling.harness.one_weight import OneWeight
from autopipe.frontend.profiling.harness.replay import LayerCall, Values
from autopipe.frontend.profiling.harness.timing import Timer, median
from executor._torch_compat import split_backward_api, tree_leaves

__all__ = ["BackwardSplit", "input_share", "measure_split", "split_columns", "split_overhead", "split_ratio"]

Overhead = tuple[float, float]  # what each half takes on a layer of one 1-element weight, ms


@dataclass(frozen=True)
class BackwardSplit:
    """One layer's two halves of a backward (ms, harness overhead not yet subtracted) and the
    bytes the first leaves for the second."""

    input_ms: float
    weight_ms: float
    weight_grad_bytes: int
    has_weights: bool


def _bytes_once(values: Any) -> int:
    seen: dict[int, int] = {}
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor):
            ptr, nbytes = storage_key(t)
            seen[ptr] = nbytes
    return sum(seen.values())


def measure_split(call: LayerCall, values: Values, timer: Timer) -> BackwardSplit | None:
    """One forward of ``call`` and its backward in torch's two halves; None where torch's halves
    are not the ones autopipe knows."""
    api = split_backward_api()
    if isinstance(api, str):
        return None
    backward_input, backward_weight = api
    args = fresh(call.arguments(values))
    weights = [p for p in call.module.parameters() if p.requires_grad]
    out = call(*args)
    roots, grads = backward_roots(out)
    if not roots:
        return BackwardSplit(0.0, 0.0, 0, bool(weights))
    inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    roots = [t.clone() for t in roots]  # torch detaches them in place, which a view refuses
    timer.synchronize()
    if not any(t.requires_grad for t in inputs):  # torch's first stage: the whole backward in W
        _, w_ms = timer(lambda: torch.autograd.backward(roots, grads))
        return BackwardSplit(0.0, w_ms, 0, bool(weights))
    with warnings.catch_warnings():  # torch sets .grad on the inputs, non-leaf copies here
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        (_, groups), i_ms = timer(lambda: backward_input(roots, grads, inputs, iter(weights)))
    held = _bytes_once([group.get("grads") for group in groups])
    _, w_ms = timer(lambda: backward_weight(iter(weights), groups))
    return BackwardSplit(i_ms, w_ms, held, bool(weights))



def split_overhead(timer: Timer, device: torch.device, precision: str = "fp32") -> Overhead:
    """The median ms of each half of a split backward of ``x * w`` with one-element tensors:
    what every layer's halves pay besides their work ([Note: split backward measured])."""
    module = fx.symbolic_trace(OneWeight().to(device))
    call = LayerCall("<scale>", module, ["x"], ["w"], precision, device)
    values = Values({"x": torch.ones(1, device=device, requires_grad=True)})
    runs = [measure_split(call, values, timer) for _ in range(CALIBRATION_REPEATS)]
    done = [r for r in runs if r is not None]
    return (median([r.input_ms for r in done]), median([r.weight_ms for r in done])) if done else (0.0, 0.0)


def input_share(split: BackwardSplit, overhead: Overhead) -> float:
    """The input half's share of the layer's backward, each half less its ``overhead``: 0 where
    no input needs a gradient (all of it is W); a layer too small to tell: all of it without
    weights, else half."""
    if split.input_ms == 0.0 and split.weight_ms > 0:
        return 0.0
    i, w = max(split.input_ms - overhead[0], 0.0), max(split.weight_ms - overhead[1], 0.0)
    if i + w <= 0:
        return 0.5 if split.has_weights else 1.0
    return i / (i + w)


def split_ratio(rows: list[dict[str, Any]], splits: dict[str, BackwardSplit], overhead: Overhead) -> float | None:
    """What the two halves took over what the whole backward took, summed over the measured
    layers (each less its overhead; the rows as timed, not yet scaled in sequence)."""
    measured = [r for r in rows if r["measured_as"] == r["layer"] and r["layer"] in splits]
    halves = sum(max(splits[r["layer"]].input_ms - overhead[0], 0.0)
                 + max(splits[r["layer"]].weight_ms - overhead[1], 0.0) for r in measured)
    whole = sum(float(r["bwd_ms"]) for r in measured)
    return round(halves / whole, 4) if whole > 0 else None


def split_columns(rows: list[dict[str, Any]], splits: dict[str, BackwardSplit], overhead: Overhead
                  ) -> list[dict[str, Any]]:
    """The rows with ``bwd_input_ms`` and ``bwd_weight_ms`` (their measured layer's input share
    of their ``bwd_ms``, the rest) and ``weight_grad_bytes``; as they are where a layer's split
    is missing (then the profile has none)."""
    if not rows or any(r["measured_as"] not in splits for r in rows):
        return rows
    out = []
    for r in rows:
        split = splits[r["measured_as"]]
        bwd_input = round(float(r["bwd_ms"]) * input_share(split, overhead), 6)
        out.append({**r, "bwd_input_ms": bwd_input, "bwd_weight_ms": round(float(r["bwd_ms"]) - bwd_input, 6),
                    "weight_grad_bytes": split.weight_grad_bytes})
    return out
