"""Save and load a checkpoint through torch.distributed.checkpoint, every rank its own part.

Both are collectives over the default process group when ``view.distributed``: every rank
calls them together. Each check that can fail (a missing folder, another model, another
optimizer, a truncated part) runs before any data moves and is agreed on by all ranks, so that
one rank's problem is every rank's one-line :class:`CheckpointError` instead of a hang in the
next collective. See [Note: a checkpoint folder] and [Note: keyed by the plain model's names].
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from executor.checkpoint.contents import (
    BLOB_PREFIX,
    CheckpointView,
    apply_optimizer_blobs,
    init_optimizer_state,
    model_entries,
    optimizer_blob,
    optimizer_entries,
    pack,
    rng_states,
    set_rng_states,
    unpack,
)
from executor.checkpoint.folders import (
    commit,
    partial_folder,
    prepare,
    prune,
    read_manifest,
    resolve,
    step_folder,
)
from executor.errors import CheckpointError

__all__ = ["SavedCheckpoint", "save", "load", "check", "Loaded"]


def _first_line(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> exception
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {_first_line(inner) if isinstance(inner, BaseException) else inner}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# What DCP warns a one-process save with; an async save's from DCP's own thread, past any
# catch_warnings, so it is ignored for good once one is asked for (a save of this process alone)
_NO_DIST_SAVE = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save"


@contextmanager
def _single_process(view: CheckpointView) -> Iterator[None]:
    """Without DCP's warning that no process group means one process: that is what a view says."""
    with warnings.catch_warnings():
        if not view.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(view: CheckpointView, problem: str) -> None:
    """Raise every rank's first problem on every rank (the ranks' checks are a collective)."""
    if view.distributed:
        problems: list[Any] = [None] * view.world
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), "")
    if problem:
        raise CheckpointError(problem)


class SavedCheckpoint:
    """A save in progress or done: ``wait()`` blocks until its folder is whole and returns it.

    An async save of ranks (``group``: the save's own process group) ends with every rank
    learning rank 0's commit, on that group in the save's background thread: without it, a rank
    other than 0 returned from ``wait()`` before rank 0 had renamed the folder, and a load of
    the root right after picked the previous step there and the new one on rank 0."""

    def __init__(self, folder: Path, future: Future[Any] | None = None,
                 commit_fn: Callable[[], None] | None = None, group: Any = None) -> None:
        self.folder, self._future, self._commit_fn, self._group = folder, future, commit_fn, group
        self._committed = threading.Event()
        self._error: str | None = None
        if future is None:
            self._finish()
        else:
            future.add_done_callback(lambda _: self._finish())

    def _finish(self) -> None:
        try:
            if self._future is not None and self._future.exception() is not None:
                self._error = _first_line(self._future.exception())  # type: ignore[arg-type]
            elif self._commit_fn is not None:
                self._commit_fn()
        except Exception as err:  # noqa: BLE001 - reported by wait()
            self._error = _first_line(err)
        try:
            if self._group is not None:  # every rank: the first rank's error, or none
                errors: list[Any] = [None] * dist.get_world_size(self._group)
                dist.all_gather_object(errors, self._error, group=self._group)
                self._error = next((e for e in errors if e is not None), None)
        except Exception as err:  # noqa: BLE001 - reported by wait()
            self._error = self._error or _first_line(err)
        finally:
            self._committed.set()

    def done(self) -> bool:
        return self._committed.is_set()

    def wait(self) -> Path:
        """The checkpoint's folder, once it is whole (raises CheckpointError if the save failed)."""
        self._committed.wait()
        if self._error is not None:
            raise CheckpointError(f"saving {str(self.folder)!r} failed ({self._error}); the previous "
                                  "checkpoints are untouched")
        return self.folder


def save(view: CheckpointView, root: str | os.PathLike[str], *, step: int,
         optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None, extra: Any = None,
         keep: int | None = None, async_save: bool = False, group: Any = None) -> SavedCheckpoint:
    """Write ``root/step-<step>/`` (see the module docstring); ``group``: the process group an
    async save of ranks talks on, a gloo group of its own (Checkpointable._checkpoint_group)."""
    root = Path(root)
    problem = ""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        problem = f"keep={keep!r}: keep at least the checkpoint being written (keep=1), or None for all"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        problem = f"step={step!r}: a checkpoint's step is an int >= 0 (the optimizer steps taken)"
    state: dict[str, Any] = model_entries(view)
    blob: dict[str, Any] = {"step": step, "rank": view.rank, "world": view.world,
                            "rng": rng_states(view.devices), "extra": extra,
                            "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
                            "optim": None}
    try:
        if optimizer is not None:
            state.update(optimizer_entries(optimizer, view))
            blob["optim"] = optimizer_blob(optimizer, view)
        state[f"{BLOB_PREFIX}{view.rank}"] = pack(blob)
    except CheckpointError as err:
        problem = problem or str(err)
    partial = partial_folder(root, step)
    if view.rank == 0 and not problem:
        try:
            prepare(root, step)
        except OSError as err:
            problem = f"cannot write a checkpoint under {str(root)!r} ({err.strerror or err}); pass a writable folder"
    _agree(view, problem)
    manifest = {"step": step, "world": view.world, "about": view.about,
                "optimizer": None if optimizer is None else type(optimizer).__name__,
                "lr_scheduler": None if lr_scheduler is None else type(lr_scheduler).__name__,
                "torch": torch.__version__}
    final = step_folder(root, step)

    def finish() -> None:  # rank 0, once every rank's part and DCP's .metadata are written
        commit(partial, final, manifest)
        prune(root, keep)

    where = {"checkpoint_id": str(partial), "no_dist": not view.distributed, "process_group": group}
    if async_save:
        if not view.distributed:  # DCP warns from its save thread, after _single_process has ended
            warnings.filterwarnings("ignore", message=_NO_DIST_SAVE, category=UserWarning)
        with _single_process(view):
            future = dcp_async_save(state, **where)
        return SavedCheckpoint(final, future, finish if view.rank == 0 else None,  # type: ignore[arg-type]
                               group=group if view.distributed else None)
    problem = ""
    try:
        with _single_process(view):
            dcp_save(state, **where)
        if view.rank == 0:
            finish()
    except Exception as err:  # noqa: BLE001 - DCP's CheckpointException, OSError: one line
        problem = f"saving {str(final)!r} failed ({_first_line(err)}); the previous checkpoints are untouched"
    _agree(view, problem)  # also: nobody reads the folder before rank 0 has renamed it
    return SavedCheckpoint(final)


class Loaded:
    """What a load returns besides the tensors it filled: the step and the caller's ``extra``."""

    def __init__(self, folder: Path, step: int, extra: Any, rng_restored: bool) -> None:
        self.folder, self.step, self.extra, self.rng_restored = folder, step, extra, rng_restored


def _model_problems(view: CheckpointView, keys: dict[str, Any], folder: Path) -> tuple[str, dict[str, Tensor]]:
    """The targets of this rank's tensors, and what makes the checkpoint another model's."""
    targets: dict[str, Tensor] = {}
    missing, shapes = [], []
    for tensor, names in view.names:
        found = next((f"model.{n}" for n in names if f"model.{n}" in keys), None)
        if found is None:
            missing.append(names[0])
            continue
        saved = getattr(keys[found], "size", None)
        if saved is None or tuple(saved) != tuple(tensor.shape):
            shapes.append(f"{names[0]} (checkpoint {tuple(saved) if saved is not None else 'not a tensor'}, "
                          f"model {tuple(tensor.shape)})")
        targets[found] = tensor.detach()
    parts = []
    if missing:
        parts.append(f"{len(missing)} of this model's tensors are not in it ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''})")
    if shapes:
        parts.append(f"shapes differ for {', '.join(shapes[:3])}{', ...' if len(shapes) > 3 else ''}")
    if not parts:
        return "", targets
    return (f"checkpoint {str(folder)!r} is of another model: {'; '.join(parts)}; load a checkpoint "
            "of this model"), targets


def _unexpected(view: CheckpointView, keys: dict[str, Any], folder: Path) -> str:
    """The checkpoint's model tensors that no rank of this pipeline holds (a collective)."""
    mine = [n for _, names in view.names for n in names]
    if view.distributed:
        everyone: list[Any] = [None] * view.world
        dist.all_gather_object(everyone, mine)
        mine = [n for names in everyone for n in names]
    extra = sorted({k[len("model."):] for k in keys if k.startswith("model.")} - set(mine))
    if not extra:
        return ""
    return (f"checkpoint {str(folder)!r} is of another model: {len(extra)} of its tensors are not in this "
            f"model ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}); load a checkpoint of this model")


def _other_problems(manifest: dict[str, Any], folder: Path, optimizer: Any, lr_scheduler: Any) -> str:
    saved = manifest.get("optimizer")
    if optimizer is not None and saved is None:
        return (f"checkpoint {str(folder)!r} was saved without an optimizer; load it without one "
                "(optimizer=None) and start the optimizer afresh")
    if optimizer is not None and saved != type(optimizer).__name__:
        return (f"checkpoint {str(folder)!r} holds {saved} state but the optimizer is "
                f"{type(optimizer).__name__}: pass a {saved}, or load without the optimizer")
    if lr_scheduler is not None and manifest.get("lr_scheduler") is None:
        return (f"checkpoint {str(folder)!r} was saved without an LR scheduler; load it without one")
    return ""


def _locate(view: CheckpointView, path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The folder ``path`` names, its manifest and DCP's keys (every rank agreeing they are whole)."""
    problem, folder, manifest, keys = "", Path(path), {}, {}
    try:
        folder = resolve(path)
        manifest = read_manifest(folder)
        keys = dict(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    except CheckpointError as err:
        problem = str(err)
    except Exception as err:  # noqa: BLE001 - an unreadable .metadata
        problem = (f"checkpoint {str(folder)!r}: its .metadata is unreadable ({_first_line(err)}); load an "
                   "earlier step's folder")
    _agree(view, problem)
    return folder, manifest, keys


def check(view: CheckpointView, path: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None,
          lr_scheduler: Any = None) -> tuple[Path, dict[str, Any]]:
    """load()'s checks of the folder, the model's tensors and shapes and the optimizer's class,
    reading only the manifest and DCP's metadata; the folder and its manifest."""
    folder, manifest, keys = _locate(view, path)
    problem, _ = _model_problems(view, keys, folder)
    _agree(view, problem or _unexpected(view, keys, folder)
           or _other_problems(manifest, folder, optimizer, lr_scheduler))
    return folder, manifest


def load(view: CheckpointView, path: str | os.PathLike[str], *, optimizer: torch.optim.Optimizer | None = None,
         lr_scheduler: Any = None) -> Loaded:
    """Fill this rank's tensors (and optimizer, scheduler, RNG) from the checkpoint at ``path``
    (a step's folder, or a root: its newest whole step)."""
    folder, manifest, keys = _locate(view, path)
    problem, state = _model_problems(view, keys, folder)
    problem = problem or _unexpected(view, keys, folder) or _other_problems(manifest, folder, optimizer,
                                                                            lr_scheduler)
    if not problem and optimizer is not None:
        try:
            init_optimizer_state(optimizer)
            state.update(optimizer_entries(optimizer, view, have=keys))
        except CheckpointError as err:
            problem = str(err)
    _agree(view, problem)
    blobs = {k: torch.empty(tuple(getattr(keys[k], "size", ())), dtype=torch.uint8)
             for k in keys if k.startswith(BLOB_PREFIX)}
    state.update(blobs)
    problem = ""
    try:
        with _single_process(view):
            dcp_load(state, checkpoint_id=str(folder), no_dist=not view.distributed)
        saved = {int(k[len(BLOB_PREFIX):]): unpack(v) for k, v in blobs.items()}
    except Exception as err:  # noqa: BLE001 - a corrupt part: one line
        problem = (f"loading checkpoint {str(folder)!r} failed ({_first_line(err)}): a part is corrupt; "
                   "load an earlier step's folder")
    _agree(view, problem)
    if view.after_load is not None:
        view.after_load()
    same_ranks = manifest.get("world") == view.world
    mine = saved.get(view.rank) if same_ranks else None
    first = mine if mine is not None else saved[min(saved)]
    if optimizer is not None:
        apply_optimizer_blobs(optimizer, view, [b["optim"] for b in saved.values() if b["optim"] is not None])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(first["lr_scheduler"])
    if mine is not None:
        set_rng_states(mine["rng"])
    return Loaded(folder, int(manifest["step"]), first["extra"], rng_restored=mine is not None)
