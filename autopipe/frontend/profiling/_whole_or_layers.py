"""profile()'s choice between one real run of the whole model and each layer alone."""

from __future__ import annotations

import torch
from torch import nn

from autopipe.core.units import parse_bytes
from autopipe.errors import AutopipeError, ProfileError
from autopipe.frontend.building.materialize import has_meta_tensors

__all__ = ["MODES", "choose_mode"]

MODES = ("auto", "whole", "layers")


def _state_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def choose_mode(mode: str, model: nn.Module, dev: torch.device,
                memory_budget: int | str | None) -> str:
    """[Note: whole or layer by layer] ``whole`` records one real run of the whole model on the
    device, so it needs the model and its activations there; ``layers`` needs one layer at a
    time ([Note: layer by layer]). ``auto`` takes ``layers`` when the model has tensors on the
    meta device, or its parameters and buffers exceed ``memory_budget`` (default on CUDA: the
    device's free memory); else ``whole``. Both give the same columns."""
    if mode not in MODES:
        raise ProfileError(f"mode={mode!r} is unknown; use one of {list(MODES)}")
    meta = has_meta_tensors(model)
    if mode == "whole" and meta:
        raise ProfileError("the model has tensors on the meta device, so it cannot run whole; "
                           "profile it layer by layer: mode='layers' (or 'auto')")
    if mode != "auto":
        return mode
    if meta:
        return "layers"
    try:
        budget = parse_bytes(memory_budget)
    except AutopipeError as err:
        raise ProfileError(str(err).replace("memory limit", "memory_budget")) from None
    if budget is None and dev.type == "cuda":
        budget = int(torch.cuda.mem_get_info(dev)[0])
    return "layers" if budget is not None and _state_bytes(model) > budget else "whole"
