"""Byte sizes for people: parse ``"16GiB"`` / ``"512MB"``, format ``1.5 GiB``. Torch-free."""

from __future__ import annotations

import re

from autopipe.errors import PartitionError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None) -> int | None:
    """``16GiB``, ``512MB``, ``1.5 gb`` or a plain number of bytes -> int bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            raise PartitionError(f"memory limit {value} is negative; give bytes >= 0 or e.g. '16GiB'")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise PartitionError(
            f"cannot read memory size {value!r}; use bytes or a number with a unit like '16GiB', '512MB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
