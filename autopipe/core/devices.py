"""Pipeline devices as the planner sees them: a name, a memory limit and a relative speed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopipe.core.units import parse_bytes
from autopipe.errors import PartitionError

__all__ = ["DeviceSpec", "resolve_devices"]


@dataclass(frozen=True)
class DeviceSpec:
    """One pipeline device: its name, memory in bytes (None = unlimited) and relative speed
    (2.0 = twice as fast as the device the profile was measured on)."""

    name: str
    memory: int | None = None
    speed: float = 1.0

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise PartitionError(f"device {self.name!r} has speed {self.speed}; speed must be > 0")
        if self.memory is not None and self.memory < 0:
            raise PartitionError(f"device {self.name!r} has negative memory {self.memory}")


def resolve_devices(
    stages: int | None,
    devices: Sequence[DeviceSpec | str] | None,
    memory_limit: int | str | None = None,
) -> list[DeviceSpec]:
    """Turn ``stages=K`` or a device list (+ a global memory limit) into K DeviceSpecs."""
    limit = parse_bytes(memory_limit)
    if devices is None:
        if stages is None:
            raise PartitionError("give stages=K or devices=[...]: the number of stages is unknown")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise PartitionError(f"stages={stages!r}: need an integer K >= 1")
        return [DeviceSpec(f"stage{k}", limit) for k in range(stages)]
    specs = [DeviceSpec(d) if isinstance(d, str) else d for d in devices]
    if not specs:
        raise PartitionError("devices=[] is empty: give at least one device")
    if stages is not None and stages != len(specs):
        raise PartitionError(f"stages={stages} but {len(specs)} devices given; drop one or make them agree")
    if limit is not None:
        specs = [DeviceSpec(d.name, limit if d.memory is None else min(d.memory, limit), d.speed) for d in specs]
    return specs
