"""What a stage's backward adds to its peak: gradients from its first backward, and each layer's
working set ([Note: the backward's memory]); the walk itself is in stage_memory.py.

    lazy = lazy_grad_bytes(params, OPTIMIZER_FACTOR["adamw"], 1, "ddp", "1f1b")
    extras = backward_extras(lazy, first_backward_bytes(saved, grads, working), working.max())
    activation_bytes(input_bytes, saved_bytes, terms, extras=extras)

[Note: the backward's memory] Two things of a step's peak happen in the backward, not between
the operations the walk counts. The gradients: ``zero_grad()`` (set_to_none, torch's default,
Trainer's and autopipe's) frees them after each step, so a stage holds none until its first
backward, which makes them layer by layer while it frees that micro-batch's saves; GPipe's
peak falls in that first backward, every other schedule's in a later one, beside all of them
(DistributedDataParallel keeps them in its buckets: charged throughout, ``lazy_grad_bytes``).
And the working set: a layer's backward allocates its inputs' and its weights' gradients (the
accumulation into existing ones allocates them again) and its kernels' temporaries, beside the
gradient it received; the profile measures it per layer as live storage
(``bwd_working_bytes``, autopipe/frontend/profiling/harness/layer_timing.py ``probe``). So each
backward of the walk is an allocation at its start, with its micro-batch still held, and every
allocation carries what it happens beside (the walk's e): ``BEFORE_BACKWARD`` none of the lazy
gradients, ``FIRST_BACKWARD`` the first backward's most over its layers in reverse
(``first_backward_bytes``: the later layers' gradients less their freed saves, plus the
layer's working set), ``GRADIENTS`` all of them, ``IN_BACKWARD`` all of them and the stage's
largest working set (with the gradient a layer receives: the bytes its readers read; what only
the loss reads gets the loss's gradient, [Note: the loss's memory], and on the last stage the
working set and the loss's gradients are the larger of the two, not their sum, since the loss's
backward ends before the layers' starts: ``working_beside_loss``). ``backward_extras`` gives
these relative to a state that holds every gradient; the DPs take their range maxima
(``range_extras``), the ILP bounds them by a variable per stage. In one process the last stage
has one more instant: after its last forward executor.GPipe gathers every micro-batch's outputs
into the batch's, a copy of them (``gathered_bytes``) beside everything then held
(``gather_terms``), for a model that computes its own loss as for one whose caller's loss reads
the gathered batch. A profile measured before the working sets keeps the old rule: every
gradient from the start, no working set. On ranks the input is received into a buffer, and
its gradient is sent while the stage goes on ([Note: receive buffers] in stage_memory.py).
Measured against live tensor bytes in docs/benchmarks.md ("Whole-step memory").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autopipe.core.layer_costs import FloatArray, LayerCosts, range_max
from autopipe.core.stage_memory import (
    BEFORE_BACKWARD,
    FIRST_BACKWARD,
    IN_BACKWARD,
    Amount,
    Extras,
    Terms,
    kept_activation_bytes,
    loss_grad_bytes,
    received_walk,
)
from executor.spec import ZERO_BUBBLE_SCHEDULES

if TYPE_CHECKING:
    from autopipe.core.cost_options import CostOptions
    from autopipe.core.stage_cost import StageCost

__all__ = ["backward_extras", "first_backward_bytes", "gather_level", "gather_terms", "gathered_bytes", "lazy_grad_bytes",
           "range_extras", "stage_backward", "stage_walk", "step_peak", "walk_maps", "working_beside_loss", "WalkMaps"]


def lazy_grad_bytes(param_bytes: Amount, optimizer_factor: int, data_parallel: int, dp_mode: str,
                    schedule: str) -> Amount:
    """Of a stage's state, the gradients that do not exist before its first backward ([Note: the
    backward's memory]): all of them (``zero_grad()`` frees them), but where none are kept
    (``optimizer_factor`` 1) or DistributedDataParallel keeps them in its buckets."""
    if optimizer_factor < 2:
        return 0
    bucketed = dp_mode == "ddp" and data_parallel > 1 and schedule not in ZERO_BUBBLE_SCHEDULES
    return 0 if bucketed else param_bytes


def first_backward_bytes(saved: FloatArray, grads: FloatArray, working: FloatArray) -> float:
    """What a stage's first backward has beside its activations ([Note: the backward's memory]):
    over its layers j (``saved``, lazy ``grads`` and ``working`` per layer, in order), the
    gradients of the layers after j less their freed saves, plus j's working set; or, once j is
    done, j's gradients less its saves too."""
    if not len(working):
        return 0.0
    after = np.concatenate([np.cumsum((grads - saved)[::-1])[::-1], [0.0]])  # after[j]: layers j, j + 1, ...
    return float(np.maximum(after[1:] + working, after[:-1]).max())


def backward_extras(lazy_grads: Amount, first: Amount, working: Amount, sending: Amount = 0) -> Extras:
    """``extras`` for :func:`activation_bytes`, indexed by the walk's e ([Note: the backward's
    memory]): relative to a state that holds every gradient, before the first backward none of
    the lazy ones, in the first backward ``first``, after it all of them, in a later backward
    the largest layer's working set on top; after the first backward the input gradient being
    sent (``sending``, [Note: receive buffers] in stage_memory.py)."""
    return (-lazy_grads, first - lazy_grads, sending, working + sending)


def stage_walk(b: StageCost, kept: bool = True) -> tuple[tuple[int, int, int, int], Extras, int]:
    """A planned stage's (input, saved, weight-held, input-saved) bytes as its walk holds them
    per micro-batch (with what it keeps per micro-batch in flight where ``kept``), its backward
    ``extras``, and what its loss and its layers recomputed alone add on top: what the simulator
    and the plan's checks walk ([Note: receive buffers] in stage_memory.py: a stage with receive
    buffers is on ranks; [Note: the loss's memory]: a plan saved before ``kept_bytes`` adds
    ``loss_bytes`` whole)."""
    walk = received_walk(b.receive_bytes > 0, b.input_bytes, b.saved_bytes, b.input_saved_bytes)
    extras = backward_extras(b.lazy_grad_bytes, b.first_backward_bytes, b.working_bytes, b.sending_bytes)
    more = b.kept_bytes if kept else 0  # kept_activation_bytes' rule: once per micro-batch a term holds
    loss = (b.loss_grad_bytes if b.kept_bytes or b.loss_grad_bytes else b.loss_bytes) if kept else 0
    return ((walk[0] + more, walk[1] + more, b.weight_held_bytes, walk[2] + more), extras,
            loss + b.recompute_bytes + b.recompute_outputs_bytes)  # a segment recomputed alone, alive again


def gather_terms(terms: Terms) -> Terms:
    """What a stage holds just after its last forward, at most what its first backward starts
    with (a recomputed micro-batch's recompute on top) and at least what a later one does: its
    backward terms, before any gradient ([Note: the backward's memory])."""
    return tuple(sorted({t[:4] + (BEFORE_BACKWARD,) for t in terms if t[4] in (FIRST_BACKWARD, IN_BACKWARD)}))


def gathered_bytes(costs: LayerCosts, chunks: int, last: Amount) -> Amount:
    """What executor.GPipe's gathering of every micro-batch's outputs into the batch's allocates
    on the last stage (``last`` true, or an array) after its last forward, beside them, for an
    instant ([Note: the backward's memory]; the level then is :func:`gather_terms`'); nothing on
    ranks."""
    amount = costs.returned * chunks if costs.runtime == "gpipe" else 0
    return np.where(last, amount, 0) if isinstance(last, np.ndarray) else (amount if last else 0)


def gather_level(costs: LayerCosts, chunks: int, input_bytes: Amount, saved_bytes: Amount, terms: Terms,
                 weight_held: Amount, input_saved: Amount, extras: Extras) -> Amount:
    """executor.GPipe's last stage at the instant it gathers every micro-batch's outputs: what
    it holds after its last forward (:func:`gather_terms`, each micro-batch with its outputs),
    and their copy (:func:`gathered_bytes`) ([Note: the backward's memory])."""
    return (kept_activation_bytes(input_bytes, saved_bytes, gather_terms(terms), weight_held, input_saved,
                                  costs.returned, 0, extras) + gathered_bytes(costs, chunks, True))


def working_beside_loss(working: Amount, loss_grads: Amount, returned: int) -> Amount:
    """The last stage's working set beside the loss's backward, which is charged on its own
    (``loss_grad_bytes``): that backward ends before the layers' starts, and leaves them the
    gradient of the model's ``returned`` outputs, so together they hold the larger of its
    gradients and the working set with that one ([Note: the backward's memory])."""
    return np.where(np.asarray(loss_grads) > 0, np.maximum(working + returned - loss_grads, 0), working)


def step_peak(stages: Sequence[StageCost]) -> int:
    """What ``optimizer.step()`` holds besides the state on a device of ``stages``: one tensor
    at a time, the largest stage's; all at once (foreach), every stage's ([Note: the optimizer
    step's memory] in stage_memory.py)."""
    amounts = [b.step_bytes for b in stages]
    return max(amounts, default=0) if all(b.one_at_a_time for b in stages) else sum(amounts)


# activation_peak's and gather_peak's maps by stage: recomputed micro-batches, then the
# input, saved, weight-held and input-saved bytes, then the backward's extras
WalkMaps = tuple[Mapping[int, int], dict[int, float], dict[int, float], dict[int, float], dict[int, float],
                 dict[int, Extras]]


def walk_maps(stages: Sequence[StageCost], recomputed: Mapping[int, int],
              kept: bool = True) -> tuple[WalkMaps, list[int]]:
    """Every planned stage's :func:`stage_walk` as the maps the device walks take, and what each
    stage's loss and recomputed layers add on top."""
    walks = [stage_walk(b, kept) for b in stages]
    held = tuple({s: float(w[0][i]) for s, w in enumerate(walks)} for i in range(4))
    return (recomputed, held[0], held[1], held[2], held[3], {s: w[1] for s, w in enumerate(walks)}), [
        w[2] for w in walks]


def range_extras(costs: LayerCosts, params: FloatArray, j0: int, j1: int, rows: int, optimizer_factor: int,
                 data_parallel: int, dp_mode: str, schedule: str, chunks: int,
                 sending: Amount = 0) -> Extras | None:
    """``extras`` of every range i < j, j0 <= j < j1, as a stage holding ``params`` (rows, j1 -
    j0) ([Note: the backward's memory]): the range maxima of :func:`first_backward_bytes`' terms
    and of the working sets, with the input gradient being ``sending`` (rows, 1); None where the
    profile did not measure them."""
    if costs.working is None:
        return None
    lazy = lazy_grad_bytes(params, optimizer_factor, data_parallel, dp_mode, schedule)
    grads = costs.params * (lazy_grad_bytes(1, optimizer_factor, data_parallel, dp_mode, schedule) > 0)
    # net[t]: saves less lazy gradients of the layers before t, so a range's first backward holds
    # max over its layers t of (net[t + 1] + working[t], net[t]) - net[j]
    net = np.concatenate([[0.0], np.cumsum(costs.saved - grads.astype(np.float64))])
    first = range_max(np.maximum(net[1:] + costs.working, net[:-1]), j0, j1, rows) - net[None, j0:j1]
    last = np.arange(j0, j1)[None, :] == len(costs)
    working = working_beside_loss(range_max(costs.working, j0, j1, rows),
                                  np.where(last, loss_grad_bytes(costs, chunks), 0), costs.returned)
    return backward_extras(lazy, first, working, sending)


def stage_backward(costs: LayerCosts, mask: FloatArray, params: int, factor: int, options: CostOptions,
                   last: bool, terms: Terms, held: tuple[int, int, int, int, int, int],
                   sending: int = 0) -> tuple[int, ...]:
    """One stage's (lazy gradients, first backward, working set, gathered outputs, what they add
    to its peak beside its activations and the loss's bytes), for stage_costs; ``held``: its
    (input, saved, weight-held, input-saved, kept, loss-gradient) bytes as its walk holds them,
    ``sending`` its input gradient in flight ([Note: receive buffers] in stage_memory.py). All 0
    where the profile did not measure the working sets."""
    if costs.working is None or not mask.any():
        return 0, 0, 0, 0, 0
    cut_in, saved, weight_held, input_saved, kept, grads = held
    lazy = int(lazy_grad_bytes(params, factor, options.data_parallel, options.dp_mode, options.schedule))
    first = int(first_backward_bytes(costs.saved[mask].astype(np.float64),
                                     costs.params[mask].astype(np.float64) * (lazy > 0),
                                     costs.working[mask].astype(np.float64)))
    working = int(working_beside_loss(int(costs.working[mask].max()), grads, costs.returned))
    gathered = int(gathered_bytes(costs, options.chunks, last))
    extras = backward_extras(lazy, first, working, sending)
    joint = kept_activation_bytes(cut_in, saved, terms, weight_held, input_saved, kept, grads, extras)
    if gathered:
        joint = max(joint, gather_level(costs, options.chunks, cut_in, saved, terms, weight_held, input_saved, extras))
    # the same walk without the extras: the activations with the loss's bytes, all stage_costs charges else
    return lazy, first, working, gathered, int(
        joint - kept_activation_bytes(cut_in, saved, terms, weight_held, input_saved, kept, grads))
