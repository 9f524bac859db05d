"""Checkpoints of a whole training run that load under any plan: ``pipe.save_checkpoint`` /
``pipe.load_checkpoint`` on every pipeline (:class:`Checkpointable`), and the same for a plain
model (:func:`save_checkpoint`, :func:`load_checkpoint`).

    pipe.save_checkpoint("ckpt", optimizer, scheduler, extra={"seen": n}, keep=3)   # ckpt/step-00000012/
    extra = pipe.load_checkpoint("ckpt", optimizer, scheduler)                     # the newest whole step

Built on torch.distributed.checkpoint ([Note: keyed by the plain model's names] in
contents.py; [Note: a checkpoint folder] in folders.py; the I/O in dcp_io.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executor.checkpoint.contents import CheckpointView, module_view
from executor.checkpoint.dcp_io import Loaded, SavedCheckpoint, check, load, save
from executor.checkpoint.folders import read_manifest, resolve

__all__ = ["Checkpointable", "CheckpointView", "SavedCheckpoint", "save_checkpoint", "load_checkpoint",
           "checkpoint_info", "check_checkpoint"]


class Checkpointable:
    """``save_checkpoint`` / ``load_checkpoint`` for a pipeline that describes its share of the
    model as a :class:`CheckpointView` (``_checkpoint_view``) and counts its ``steps``."""

    steps: int
    _pending_save: SavedCheckpoint | None = None
    _gloo_group: dist.ProcessGroup | None = None

    def _checkpoint_view(self) -> CheckpointView:
        raise NotImplementedError

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """The process group an async save of ranks talks on: a gloo group of every rank for
        checkpoints alone, made on first use (a collective, as the save is). Never the default
        group, even a gloo one: DCP runs the save's collectives in a background thread, and
        any the caller runs meanwhile on the same group (a training loop's all_reduce of its
        loss) would be ordered differently on each rank, which hangs both."""
        if getattr(self, "_gloo_group", None) is None:
            self._gloo_group = dist.new_group(backend="gloo")
        assert self._gloo_group is not None
        return self._gloo_group

    def _wait_for_save(self) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def save_checkpoint(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                        lr_scheduler: Any = None, extra: Any = None, *, step: int | None = None,
                        keep: int | None = None, async_save: bool = False) -> SavedCheckpoint:
        """Save the model (this rank's share), ``optimizer``, ``lr_scheduler``, every rank's RNG
        states, the step and ``extra`` (plain data, e.g. a sampler's position) under
        ``path/step-<step>/``; on ranks a collective (every rank calls it).

        ``step`` defaults to ``pipe.steps`` (training mini-batches run); ``keep=N`` keeps the
        newest N checkpoints under ``path``; ``async_save=True`` returns once the state is copied
        and writes in the background (``.wait()`` on the returned handle; the next save or load
        waits for it). A crash mid-save leaves the previous checkpoints whole.
        """
        self._wait_for_save()
        view = self._checkpoint_view()
        group = self._checkpoint_group() if async_save and view.distributed else None
        saved = save(view, path, step=self.steps if step is None else step, optimizer=optimizer,
                     lr_scheduler=lr_scheduler, extra=extra, keep=keep, async_save=async_save, group=group)
        self._pending_save = saved if async_save else None
        return saved

    def load_checkpoint(self, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                        lr_scheduler: Any = None) -> Any:
        """Load a checkpoint written under any plan (or from the plain model) into this pipeline,
        ``optimizer`` and ``lr_scheduler``; ``path`` is a step's folder or the folder given to
        save_checkpoint (its newest whole step). Sets ``pipe.steps``, restores this rank's RNG
        states when the checkpoint was written by as many ranks, and returns ``extra``."""
        self._wait_for_save()
        loaded = load(self._checkpoint_view(), path, optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.steps = loaded.step
        return loaded.extra


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    lr_scheduler: Any = None, extra: Any = None, *, step: int, keep: int | None = None,
                    async_save: bool = False) -> SavedCheckpoint:
    """A plain model's checkpoint, in this process alone, that any pipeline loads."""
    return save(module_view(model, devices=[t.device for t in model.state_dict().values()]), path, step=step,
                optimizer=optimizer, lr_scheduler=lr_scheduler, extra=extra, keep=keep, async_save=async_save)


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    lr_scheduler: Any = None) -> Loaded:
    """Load a pipeline's (or a plain model's) checkpoint into the plain ``model`` and optimizer,
    in this process alone; the step and ``extra`` are the returned value's ``.step``, ``.extra``."""
    return load(module_view(model), path, optimizer=optimizer, lr_scheduler=lr_scheduler)


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` names: its step, folder, ranks and plan."""
    folder = resolve(path)
    return {**read_manifest(folder), "folder": str(folder)}


def check_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     lr_scheduler: Any = None) -> dict[str, Any]:
    """Raise :class:`CheckpointError` (one line) unless the checkpoint ``path`` names would load
    into the plain ``model`` (every tensor, by name and shape), ``optimizer`` (its class) and
    ``lr_scheduler``, reading only its manifest and metadata, in this process alone; else its
    manifest, as :func:`checkpoint_info` gives it."""
    folder, manifest = check(module_view(model), path, optimizer=optimizer, lr_scheduler=lr_scheduler)
    return {**manifest, "folder": str(folder)}
