"""What a checkpoint holds, keyed by the plain model's names: model, optimizer, and per rank
the step, RNG, LR scheduler and the caller's ``extra``.

[Note: keyed by the plain model's names] A checkpoint must not care which plan wrote it. Every
tensor is therefore saved under the name ``model.state_dict()`` gives it, whichever stage
or rank holds it: ``model.<name>`` for parameters and buffers, ``optim.<name>.<state>`` (e.g.
``optim.h.0.mlp.weight.exp_avg``) for a parameter's optimizer state. A tied tensor is saved
once, under the least of its names (every writer knows them all: a pipeline's keys come from
the plain model's state_dict), and loaded from the first of its names the checkpoint has.
Data-parallel replicas save the same keys (DCP writes one copy); FSDP's sharded parameters and states are DTensors, which DCP saves as shards and reshards on load, so a
checkpoint of K stages x D replicas (DDP or FSDP) loads under any other plan, into one process,
or into the plain model. Everything that is not a tensor of the model or optimizer (the step,
RNG states, the LR scheduler's and optimizer's hyperparameters, ``extra``) is one small blob per
rank, ``autopipe.rank<R>``: ``torch.save`` bytes in a uint8 tensor, read back with
``weights_only=True`` (so a checkpoint cannot run code), which every rank of a later run reads.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from executor.errors import CheckpointError

__all__ = ["CheckpointView", "module_view", "model_entries", "optimizer_entries", "init_optimizer_state",
           "optimizer_blob", "apply_optimizer_blobs", "pack", "unpack", "rng_states", "set_rng_states",
           "BLOB_PREFIX"]

BLOB_PREFIX = "autopipe.rank"


@dataclass
class CheckpointView:
    """One rank's share of a pipeline, as checkpoints see it.

    ``names``: this rank's parameters and buffers (``keep_vars`` tensors) -> every name the plain
    model gives them; ``rank`` / ``world``: this process in the default group (0 / 1 and
    ``distributed=False`` for one process); ``devices``: where its tensors live (their CUDA RNGs
    are saved); ``about``: the plan that writes, recorded in the manifest; ``after_load``: run
    after the tensors are loaded (a one-process pipeline copies a tie to its other devices)."""

    names: list[tuple[Tensor, list[str]]]
    rank: int = 0
    world: int = 1
    distributed: bool = False
    devices: Sequence[torch.device] = ()
    about: dict[str, Any] = field(default_factory=dict)
    after_load: Callable[[], None] | None = None


def module_view(module: nn.Module, **kwargs: Any) -> CheckpointView:
    """A plain module's view: every tensor of its state_dict under all of its names."""
    by_id: dict[int, tuple[Tensor, list[str]]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), (tensor, []))[1].append(key)
    return CheckpointView(names=list(by_id.values()), **kwargs)


def model_entries(view: CheckpointView) -> dict[str, Tensor]:
    """``model.<name>`` -> a detached alias of the tensor (DCP saves from and loads into it)."""
    return {f"model.{min(names)}": tensor.detach() for tensor, names in view.names}


def _param_names(view: CheckpointView) -> dict[int, list[str]]:
    return {id(tensor): names for tensor, names in view.names if isinstance(tensor, nn.Parameter)}


def _names_of(optimizer: torch.optim.Optimizer, view: CheckpointView) -> list[list[list[str]]]:
    """Per parameter group, per parameter: its names (one line if the pipeline lacks it)."""
    known = _param_names(view)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        names = []
        for i, p in enumerate(group["params"]):
            if id(p) not in known:
                raise CheckpointError(f"the optimizer's parameter {i} of group {g} (shape {tuple(p.shape)}) is "
                                      "not one of this pipeline's: build the optimizer over "
                                      "pipe.parameters() (on ranks: pipe.stage_module.parameters())")
            names.append(known[id(p)])
        out.append(names)
    return out


def optimizer_entries(optimizer: torch.optim.Optimizer, view: CheckpointView,
                      have: Iterable[str] | None = None) -> dict[str, Tensor]:
    """``optim.<name>.<state>`` -> each tensor of the optimizer's state; with ``have`` (the keys
    a checkpoint holds), each under the first of its names found there."""
    present = None if have is None else set(have)
    out: dict[str, Tensor] = {}
    for group, names in zip(optimizer.param_groups, _names_of(optimizer, view), strict=True):
        for p, aliases in zip(group["params"], names, strict=True):
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, Tensor):
                    continue
                if present is None:
                    out[f"optim.{min(aliases)}.{key}"] = value
                    continue
                found = next((f"optim.{n}.{key}" for n in aliases if f"optim.{n}.{key}" in present), None)
                if found is None:
                    raise CheckpointError(f"the checkpoint has no optimizer state {key!r} for parameter "
                                          f"{aliases[0]!r}: it was saved without this optimizer, or with "
                                          f"another kind; pass the optimizer it was saved with, or none")
                out[found] = value
    return out


def optimizer_blob(optimizer: torch.optim.Optimizer, view: CheckpointView) -> dict[str, Any]:
    """What of the optimizer is not a state tensor: its class, each group's hyperparameters
    (with its parameters' names) and non-tensor state values."""
    groups, other = [], {}
    for group, names in zip(optimizer.param_groups, _names_of(optimizer, view), strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [n for aliases in names for n in aliases]})
        for p, aliases in zip(group["params"], names, strict=True):
            plain = {k: v for k, v in optimizer.state.get(p, {}).items() if not isinstance(v, Tensor)}
            if plain:
                other[aliases[0]] = plain
    return {"class": type(optimizer).__name__, "groups": groups, "other": other}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its state tensors (a fresh optimizer has none to load into): one step
    on zero gradients at learning rate 0, as torch.distributed.checkpoint.state_dict does."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(p in optimizer.state for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
        optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr


def apply_optimizer_blobs(optimizer: torch.optim.Optimizer, view: CheckpointView,
                          blobs: Sequence[dict[str, Any]]) -> None:
    """Each local group's hyperparameters from the saved group holding its first parameter
    (whichever rank saved it), and the non-tensor state values."""
    saved_groups = {name: group for blob in blobs for group in blob["groups"] for name in group["params"]}
    other = {name: values for blob in blobs for name, values in blob["other"].items()}
    for group, names in zip(optimizer.param_groups, _names_of(optimizer, view), strict=True):
        if not names:
            continue
        saved = next((saved_groups[n] for n in names[0] if n in saved_groups), None)
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
        for p, aliases in zip(group["params"], names, strict=True):
            values = next((other[n] for n in aliases if n in other), None)
            if values:
                optimizer.state[p].update(values)


def pack(obj: Any) -> Tensor:
    """``obj`` as torch.save bytes in a uint8 tensor (refused unless weights_only can read it)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        data = buffer.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # noqa: BLE001 - what pickle or weights_only refuses
        raise CheckpointError(f"extra / the LR scheduler's state must be plain data (dict, list, str, "
                              f"numbers, tensors) to be loaded safely: {str(err).splitlines()[0]}") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(blob: Tensor) -> Any:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def rng_states(devices: Iterable[torch.device]) -> dict[str, Tensor]:
    """The CPU generator's state and each CUDA device's of ``devices``."""
    states = {"cpu": torch.get_rng_state()}
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            states[str(device)] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Tensor]) -> None:
    for where, state in states.items():
        if where == "cpu":
            torch.set_rng_state(state)
        elif torch.cuda.is_available():
            torch.cuda.set_rng_state(state, torch.device(where))
