from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from autopipe.core.atomic_files import atomic_write, atomic_write_text


def test_writes_with_ordinary_permissions(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "sub" / "a.json", "{}\n")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "a.json"
    assert path.read_text() == "{}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]  # no temporary left


def test_failure_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("saved by the user")

    def explode(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, explode)
    assert path.read_text() == "saved by the user"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
