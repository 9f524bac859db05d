"""What the loss costs the last stage: timed on the model's output, into the profile's metadata.

    prof = profile(model, (x,), chunks=4, loss_fn=loss_fn, target=target)   # step "loss"
    prof.corrections.loss          # LossCost(fwd_ms=..., bwd_ms=..., micro_batch_size=...)

[Note: the loss in the last stage] Every runtime computes the loss on the last stage's output and
back-propagates it there first, so the last stage pays the loss's forward and backward for every
micro-batch, and no layer of the traced graph holds them. Over a language model's logits it is
not small: it grows with rows x vocabulary, so a head over a vocabulary of tens of thousands of
tokens pays a visible share of the last stage's time.
:func:`with_loss` times ``loss_fn(output, target)`` and its backward on one micro-batch (the
profile's rows, on the profiled device; the output detached as a leaf, so only the loss runs)
into ``corrections.loss`` (autopipe/core/corrections.py). The cost model adds both to the LAST
layer's backward (autopipe/core/layer_costs.py): the last stage always holds the last layer, and
a backward is never recomputed, so every solver, the Plan and the simulator charge it once per
micro-batch to the last stage; what the loss holds in memory is counted beside its time
(``loss_bytes``, [Note: the loss's memory] in autopipe/core/stage_memory.py). At another micro-batch size it scales with the rows
([Note: micro-batch scaling] in autopipe/core/scaling.py). A model on the meta device, or one
profiled layer by layer (which may not fit the device whole), is never run whole ([Note: layer
by layer]): its profile keeps no loss time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopipe.core.corrections import LossCost
from autopipe.core.planned_precision import precision_of
from autopipe.errors import ProfileError
from autopipe.frontend.building.materialize import has_meta_tensors
from autopipe.frontend.profiling.harness.inputs import micro_batch, to_device
from autopipe.frontend.profiling.harness.preserve import preserved
from autopipe.frontend.profiling.harness.timing import Timer, median, timer_for
from autopipe.frontend.profiling.harness.under_autocast import autocast_call
from executor._torch_compat import tree_map_only
from executor.memory_meter import MemoryMeter

if TYPE_CHECKING:
    from autopipe.core.profile_table import Profile

__all__ = ["LOSS_REPEATS", "loss_bytes", "loss_ms", "with_loss"]

LOSS_REPEATS = 10
LOSS_WARMUP = 2


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point() or t.is_complex())


def loss_ms(output: Any, target: Any, loss_fn: Callable[[Any, Any], Any], timer: Timer,
            repeats: int = LOSS_REPEATS, warmup: int = LOSS_WARMUP) -> tuple[float, float]:
    """Median ms of ``loss_fn(output, target)`` and of its backward, the output a fresh leaf
    each time ([Note: the loss in the last stage])."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        out = tree_map_only(torch.Tensor, _leaf, output)
        timer.synchronize()
        try:
            loss, f_ms = timer(functools.partial(loss_fn, out, target))
        except Exception as err:  # noqa: BLE001 - the user's loss: one line, not its traceback
            raise ProfileError(f"loss_fn(output, target) failed on one micro-batch ({type(err).__name__}: "
                               f"{err}); pass the loss and target the pipeline will train with") from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ProfileError(f"loss_fn(output, target) returned {type(loss).__name__}"
                               f"{' of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else ''}"
                               "; it must return a scalar tensor, as the pipeline back-propagates it")
        b_ms = timer(loss.backward)[1] if loss.requires_grad else 0.0
        if i >= warmup:
            fwd.append(f_ms)
            bwd.append(b_ms)
    return median(fwd), median(bwd)


def loss_bytes(output: Any, target: Any, loss_fn: Callable[[Any, Any], Any]) -> tuple[int, int]:
    """(held, peak) bytes of ``loss_fn(output, target)`` and its backward on a fresh leaf of the
    output, counted as live tensor storage ([Note: counting live bytes] in
    executor/memory_meter.py): what the forward keeps for the backward, and the most alive at
    once; the output itself is the caller's, counted by neither ([Note: the loss's memory] in
    autopipe/core/stage_memory.py)."""
    out = tree_map_only(torch.Tensor, _leaf, output)
    meter = MemoryMeter()
    with meter:
        loss = loss_fn(out, target)
        held = meter.live
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return held, meter.peak


def with_loss(profile: Profile, model: nn.Module, example_inputs: Any, target: Any,
              loss_fn: Callable[[Any, Any], Any] | None, device: str | torch.device | None = None) -> Profile:
    """``profile`` with the loss's time per micro-batch in its corrections ([Note: the loss in
    the last stage]); the step "loss" of ``autopipe.profile`` ([Note: one list of measurement steps]); ``example_inputs`` and ``target`` are the batch the profile was measured on
    (each sliced to one micro-batch by the profile's chunks, as the profiler does). Without a
    loss or a target (a model given without them), the profile as it is."""
    meta = dict(profile.meta)
    if loss_fn is None or target is None:
        return profile
    if has_meta_tensors(model) or meta.get("mode") == "layers":
        return profile  # never run whole: it may not fit where it was profiled
    chunks = int(meta.get("chunks") or 1)
    inputs, batch, micro = micro_batch(example_inputs, chunks)
    try:
        targets, target_batch, _ = micro_batch(target, chunks)
    except ProfileError as err:
        raise ProfileError(f"target: {err}") from None
    if batch != target_batch:
        raise ProfileError(f"the target has {target_batch} rows and the inputs {batch}; pass the "
                           "target of the same batch")
    if meta.get("batch_size") not in (None, batch):
        raise ProfileError(f"the profile was measured on a batch of {meta['batch_size']} rows, these "
                           f"inputs have {batch}; pass the batch it was measured on")
    dev = torch.device(device if device is not None else str(meta.get("device_type") or "cpu"))
    precision = precision_of(meta)  # the output's dtype and the loss's: [Note: profiling under a precision]
    with preserved(model, dev):
        with torch.no_grad():
            output = autocast_call(model, precision, dev)(*to_device(inputs, dev))
        on_device = to_device(targets, dev)
        target_value = on_device if isinstance(target, tuple) else on_device[0]
        call = autocast_call(loss_fn, precision, dev)
        fwd, bwd = loss_ms(output, target_value, call, timer_for(dev))
        held, peak = loss_bytes(output, target_value, call)
    loss = LossCost(round(fwd, 6), round(bwd, 6), micro, held, peak)
    return dataclasses.replace(profile, corrections=dataclasses.replace(profile.corrections, loss=loss))
