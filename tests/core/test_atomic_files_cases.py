"""autopipe/core/atomic_files.py: where the temporary file lives, and folders made on the way."""

from __future__ import annotations

from pathlib import Path

from autopipe.core.atomic_files import atomic_write, atomic_write_text


def test_the_temporary_file_is_a_hidden_sibling_then_the_file(tmp_path: Path) -> None:
    path = tmp_path / "plans" / "v1" / "plan.json"  # two folders that do not exist yet
    seen: list[Path] = []

    def write(tmp: str) -> None:
        seen.append(Path(tmp))
        Path(tmp).write_text("{}", encoding="utf-8")

    atomic_write(path, write)
    [tmp] = seen
    # beside its target (os.replace is atomic only within one file system), hidden, and named
    # after it, so a crash leaves an obviously temporary file next to the one it was for
    assert tmp.parent == path.parent
    assert tmp.name.startswith(".plan.json.") and tmp.name.endswith(".tmp")
    assert not tmp.exists() and path.read_text(encoding="utf-8") == "{}"
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]


def test_text_is_written_as_utf8(tmp_path: Path) -> None:
    atomic_write_text(tmp_path / "deep" / "er" / "a.txt", "micro-batch µ ≤ 4\n")
    assert (tmp_path / "deep" / "er" / "a.txt").read_bytes() == "micro-batch µ ≤ 4\n".encode()
