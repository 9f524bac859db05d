"""Put stages on their devices: device checks, moves, and parameters tied across devices.

[Note: ties across devices] A Parameter used by stages on different devices (a GPT's token
embedding and its tied output head) stays registered only on the first stage that uses it, on
that stage's device. Each later stage on another device has it unregistered (from the stage's
own shallow copies of the modules on its path: the user's model is not changed) and, at the
start of every forward, gets a differentiable copy (``param.to(device)``) set as a plain
attribute in its place: autograd sends that copy's gradient back into the one Parameter, so the tie holds, the
optimizer sees one tensor, and the weight crosses devices once per mini-batch, not per
micro-batch. The state_dict key of the removed name must then come from the first stage
(autopipe.build registers every alias of a tied tensor on each stage that holds it). The copies
have registries of their own (parameters, buffers, which buffers are persistent), so the stage
saves what the user's modules save and changing one never changes the other.

[Note: a pipeline stays where it was placed] Each stage runs on the device it was built for, and
the runtime sends every micro-batch there. ``pipe.to(device)``, ``.cuda()`` or ``.cpu()`` would
move every stage onto one device behind the runtime's back (HuggingFace's Trainer and accelerate
call them on the model they are given), so a move that changes any stage's device is refused in
one line (torchgpipe refuses every move); one that changes none (a CPU pipeline moved to the CPU)
and a dtype alone go through.
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import copy as shallow_copy
from dataclasses import dataclass

import torch
from torch import nn

from executor.errors import PlacementError
from executor.local.worker import normalize_device

__all__ = ["Remote", "check_devices", "check_move", "place"]


def check_devices(devices: Sequence[torch.device | str | int], n: int) -> list[torch.device]:
    """One usable device per stage, normalised (``"cuda"`` -> ``cuda:0``), or PlacementError."""
    if len(devices) != n:
        raise PlacementError(
            f"got {len(devices)} devices for {n} stages: each stage needs exactly one device; "
            f"pass len(devices) == {n} (repeat a device to put stages together)"
        )
    for d in devices:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise PlacementError(
                f"device {str(dev)!r} requested but CUDA is not available; use 'cpu' devices"
            )
    return [normalize_device(d) for d in devices]


def check_move(devices: Sequence[torch.device], args: Sequence[object], kwargs: dict[str, object],
               call: str) -> None:
    """PlacementError where ``module.to(*args, **kwargs)`` (or ``call``'s ``.cuda()``/``.cpu()``)
    would move a stage off its device ([Note: a pipeline stays where it was placed])."""
    target = kwargs.get("device")
    for arg in args:
        if isinstance(arg, torch.Tensor):
            target = arg.device
        elif isinstance(arg, str | int | torch.device):
            target = arg
    if target is None:
        return
    dev = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)  # type: ignore[call-overload]
    if dev.type != "cuda" or dev.index is not None or torch.cuda.is_available():
        dev = normalize_device(dev)  # "cuda" is the current one
    moved = sorted({str(d) for d in devices if not _same_device(d, dev)})
    if moved:
        raise PlacementError(
            f"{call} would move stages on {', '.join(moved)} onto {dev}, but each stage runs on the device "
            f"the pipeline was built for ({', '.join(str(d) for d in devices)}); build the pipeline for "
            f"the devices you want instead: pipeline(model, ..., devices=[...])")


@dataclass
class Remote:
    """A parameter a stage uses but does not hold: it lives on another stage's device."""

    module: nn.Module  # the submodule that used to register it
    attr: str
    param: nn.Parameter
    device: torch.device

    def fetch(self) -> None:
        # a differentiable copy: its gradient flows back into the one real Parameter
        setattr(self.module, self.attr, self.param.to(self.device, copy=True))


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a == b


def place(stages: Sequence[nn.Module], devices: list[torch.device]) -> list[Remote]:
    """Move each stage to its device; a parameter tied between stages on different devices
    stays on its first stage and is fetched by the others ([Note: ties across devices])."""
    home: dict[int, int] = {}
    remotes: list[Remote] = []
    for j, stage in enumerate(stages):
        for name, tensor in stage.named_parameters(remove_duplicate=False):
            first = home.setdefault(id(tensor), j)
            if first != j and not _same_device(devices[first], devices[j]):
                module = stage.get_submodule(name.rpartition(".")[0])
                if any(module is m for m in stages[first].modules()):
                    raise PlacementError(
                        f"module {name.rpartition('.')[0]!r} is used by stage {first} "
                        f"({devices[first]}) and stage {j} ({devices[j]}): a module cannot live "
                        "on two devices; put both stages on one device or colocate its layers"
                    )
                owner = _private_path(stage, name.rpartition(".")[0])
                remotes.append(Remote(owner, name.rpartition(".")[2], tensor, devices[j]))
        for name, buffer in stage.named_buffers(remove_duplicate=False):
            first = home.setdefault(id(buffer), j)
            if first != j and not _same_device(devices[first], devices[j]):
                raise PlacementError(
                    f"buffer {name!r} of stage {j} ({devices[j]}) is shared with stage {first} "
                    f"({devices[first]}): buffers cannot be shared across devices; put both "
                    "stages on one device"
                )
    for r in remotes:  # unregister before .to(), which would move the one real Parameter
        del r.module._parameters[r.attr]
    for stage, device in zip(stages, devices, strict=True):
        stage.to(device)  # keeps Parameter objects (and so ties and user references)
    return remotes


def _private_path(stage: nn.Module, path: str) -> nn.Module:
    """Give ``stage`` its own shallow copies of the modules on ``path`` (same Parameters, own
    registries), so unregistering a tied parameter there leaves the user's model untouched."""
    parent = stage
    for part in filter(None, path.split(".")):
        child = parent._modules[part]
        assert child is not None
        clone = shallow_copy(child)
        clone._parameters = dict(child._parameters)
        clone._buffers = dict(child._buffers)
        clone._non_persistent_buffers_set = set(child._non_persistent_buffers_set)
        clone._modules = dict(child._modules)
        parent._modules[part] = clone
        parent = clone
    return parent
