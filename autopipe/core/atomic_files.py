"""Write a file all or nothing: the one way autopipe saves profiles, plans and figures.

A temporary file in the same folder is written, given the permissions a plain ``open(path,
"w")`` would give it (0666 less the umask; ``mkstemp`` alone would leave 0600), then moved over
``path`` with ``os.replace``. A failure part-way leaves whatever was at ``path`` untouched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call ``write(tmp_path)`` to fill a temporary file, then move it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, all or nothing."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
