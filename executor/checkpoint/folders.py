"""Where checkpoints live on disk: one folder per step, written aside and renamed when whole.

[Note: a checkpoint folder] ``save_checkpoint(root)`` writes ``root/step-00000012/``: the parts
torch.distributed.checkpoint writes (``__R_0.distcp`` per rank, ``.metadata``) and
``autopipe-checkpoint.json`` (the step, who wrote it, the optimizer's class). Every rank writes
into ``root/step-00000012.partial/`` first; only when all of them have written (and DCP's
``.metadata`` exists) does rank 0 write the JSON and rename the folder, so a crash mid-save
leaves the previous step's folder whole and a ``.partial`` folder that loading ignores (the
next save of that step removes it). ``keep=N`` then removes all but the newest N steps'
folders, and only folders named by this scheme. Loading takes a step's folder, or a root and
then its newest whole step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from executor.errors import CheckpointError

__all__ = ["MANIFEST", "step_folder", "partial_folder", "committed_steps", "resolve", "prepare",
           "commit", "prune", "read_manifest"]

MANIFEST = "autopipe-checkpoint.json"
FORMAT = 1
_STEP = re.compile(r"step-(\d{8,})")


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def partial_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}.partial"


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """The whole checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP.fullmatch(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder to load: ``path`` itself, or the newest whole step under it."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass the folder given to "
                              "save_checkpoint (or --checkpoint-dir), or one of its step-* folders")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a file, not a folder; pass the folder given "
                              "to save_checkpoint (or --checkpoint-dir)")
    steps = committed_steps(path)
    if steps:
        return steps[-1][1]
    partial = sorted(p.name for p in path.glob("step-*.partial"))
    if partial:
        raise CheckpointError(f"{str(path)!r} holds only a save that did not finish ({partial[-1]}); "
                              "no whole checkpoint to load: start from scratch or pass another folder")
    if (path / ".metadata").is_file():
        raise CheckpointError(f"{str(path)!r} is a torch.distributed.checkpoint folder without "
                              f"{MANIFEST}: it was not written by save_checkpoint (or its save did "
                              "not finish); load it with torch.distributed.checkpoint.load")
    raise CheckpointError(f"{str(path)!r} holds no checkpoint (no step-* folder with {MANIFEST}); "
                          "pass the folder given to save_checkpoint (or --checkpoint-dir)")


def prepare(root: Path, step: int) -> Path:
    """An empty ``.partial`` folder for ``step`` (a stale one from a crashed save removed)."""
    partial = partial_folder(root, step)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest into ``partial`` and rename it to ``final`` (an older ``final`` of the
    same step is replaced only once the new one is whole)."""
    files = {p.name: p.stat().st_size for p in sorted(partial.iterdir()) if p.is_file()}
    text = json.dumps({"format": FORMAT, **manifest, "files": files}, indent=1, sort_keys=True)
    with open(partial / MANIFEST, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_folder(final.parent)
    if replaced.exists():
        shutil.rmtree(replaced)


def prune(root: Path, keep: int | None) -> list[Path]:
    """Remove all but the newest ``keep`` whole checkpoints under ``root``; the removed folders."""
    if keep is None:
        return []
    old = [path for _, path in committed_steps(root)[:-keep]]
    for path in old:
        shutil.rmtree(path)
    return old


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest, after checking that every part it lists is there and whole."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("not an autopipe checkpoint manifest")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(folder)!r}: {MANIFEST} is unreadable or corrupt "
                              f"({type(err).__name__}: {err}); load an earlier step's folder") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(folder)!r} has format {manifest.get('format')!r}; "
                              f"this autopipe reads format {FORMAT}: load it with the autopipe that wrote it")
    for name, size in manifest["files"].items():
        part = folder / name
        have = part.stat().st_size if part.is_file() else None
        if have != size:
            what = "is missing" if have is None else f"has {have} bytes of {size}"
            raise CheckpointError(f"checkpoint {str(folder)!r}: part {name} {what} (truncated or "
                                  "corrupt); load an earlier step's folder")
    return manifest
