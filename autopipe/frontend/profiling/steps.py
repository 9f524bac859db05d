"""The measurement steps of ``autopipe.profile``, in order, each filling one field of Corrections.

[Note: one list of measurement steps] ``profile(model, inputs, *, loss_fn=None, target=None,
comm=False, ...)`` is the one place a profile is assembled; the command line (``autopipe
profile``, ``run``, ``train``), ``pipeline()``, rank 0 of ``distributed_pipeline()`` and the
benchmarks all go through it. Its steps, in this order:

1. ``stage calls``: executor.GPipe's empty stage call, plain and checkpointed
   (``stage_calls["gpipe"]``, ``recompute_call_ms``: [Note: measured overheads]); first, as the
   whole graph's recompute ratio is taken net of it.
2. ``layers``: every layer's row, the layer harness's own call subtracted (``harness``), the
   recompute ratio sampled on the heaviest layers (profiler.py, overheads.py).
3. ``sequence``: the whole graph in sequence (``sequence``, and the runtime's own
   ``recompute_ratio``), when the model runs whole ([Note: layers in sequence]).
4. ``loss``: with ``loss_fn`` and ``target``, the loss on the model's output (``loss``:
   [Note: the loss in the last stage]).
5. ``rank contention`` and 6. ``transfer``: with ``comm=True``, the model beside a copy of
   itself (``rank_compute_slowdown``: [Note: ranks sharing a host]) and two spawned ranks
   (``transfer`` and ``stage_calls["distributed"]``: [Note: measured transfer]).

Steps 1-3 run inside the layer measurement (profiler.py); :func:`later_steps` runs 4-6 on its
result. Each step writes only its own fields ([Note: one profile, two runtimes] in
autopipe/core/corrections.py), so no step renames or overwrites another's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autopipe.core.corrections import Corrections, InSequence, Phases
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.corrections.in_sequence import SequenceScales

__all__ = ["STEPS", "check_steps", "later_steps", "measured_corrections"]

STEPS = ("stage calls", "layers", "sequence", "loss", "rank contention", "transfer")


def measured_corrections(harness: tuple[float, float], calls: tuple[float, float, float], ratio: float,
                         scales: SequenceScales, whole: bool) -> Corrections:
    """Steps 1-3's fields: the harness, executor.GPipe's stage call and what checkpointing it
    adds (:func:`~autopipe.frontend.profiling.corrections.overheads.stage_call_ms`), the recompute ``ratio``
    and, for a model run ``whole``, the sequence scales."""
    return Corrections(
        harness=Phases(round(harness[0], 6), round(harness[1], 6)),
        stage_calls={"gpipe": {"gpipe": Phases(round(calls[0], 6), round(calls[1], 6))}},
        recompute_call_ms=round(calls[2], 6),
        recompute_ratio=round(ratio, 4),
        sequence=InSequence(round(scales.fwd, 4), round(scales.bwd, 4), scales.rounds) if whole else None,
    )


def check_steps(loss_fn: Callable[[Any, Any], Any] | None, target: Any, comm: bool) -> None:
    """One line for arguments of steps 4-6 that cannot run, before anything is measured."""
    if not isinstance(comm, bool):
        raise ProfileError(f"comm must be True or False, got {comm!r}; comm=True measures two ranks (10-20 s)")
    if loss_fn is not None and not callable(loss_fn):
        raise ProfileError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if (loss_fn is None) != (target is None):
        given, missing = ("loss_fn", "target") if target is None else ("target", "loss_fn")
        raise ProfileError(f"{given} was given without {missing}; pass both to time the loss, or neither")


def later_steps(prof: Profile, model: nn.Module, example_inputs: Any, *, device: str | torch.device,
                loss_fn: Callable[[Any, Any], Any] | None, target: Any, comm: bool) -> Profile:
    """Steps 4-6 on the layers' profile ([Note: one list of measurement steps]); their arguments
    were checked by :func:`check_steps` before anything was measured."""
    from autopipe.frontend.profiling.corrections.loss_timing import with_loss
    from autopipe.frontend.profiling.spawned.comm import with_comm
    from autopipe.frontend.profiling.spawned.rank_contention import with_rank_contention

    steps: list[tuple[str, Callable[[Profile], Profile]]] = [
        ("loss", lambda p: with_loss(p, model, example_inputs, target, loss_fn, device=device)),
        ("rank contention", lambda p: with_rank_contention(p, model, example_inputs)),
        ("transfer", lambda p: with_comm(p, device=device)),
    ]
    wanted = {"loss": loss_fn is not None, "rank contention": comm, "transfer": comm}
    for name, step in steps:
        if wanted[name]:
            prof = step(prof)
    return prof
