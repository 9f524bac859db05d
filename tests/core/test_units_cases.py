"""autopipe/core/units.py and devices.py: every unit, each boundary and each refusal, by hand."""

from __future__ import annotations

import pytest

from autopipe.core.devices import DeviceSpec, resolve_devices
from autopipe.core.units import format_bytes, parse_bytes
from autopipe.errors import PartitionError


@pytest.mark.parametrize(("text", "expected"), [
    ("7", 7), ("7b", 7), ("7B", 7), ("2kb", 2000), ("2MB", 2_000_000), ("2gb", 2 * 10**9),
    ("2TB", 2 * 10**12), ("2KiB", 2048), ("2mib", 2 << 20), ("2GIB", 2 << 30), ("2TiB", 2 << 40),
    ("  1.5 KiB  ", 1536), (".5kib", 512), ("0", 0), ("1.9", 1),
])
def test_parse_bytes_reads_every_unit(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_takes_numbers_as_bytes() -> None:
    assert parse_bytes(0) == 0 and parse_bytes(0.0) == 0  # zero is a limit, not a refusal
    assert parse_bytes(1536.9) == 1536 and isinstance(parse_bytes(1536.9), int)
    assert parse_bytes(None) is None
    with pytest.raises(PartitionError, match=r"^memory limit -1 is negative; give bytes >= 0 or e\.g\. '16GiB'$"):
        parse_bytes(-1)
    with pytest.raises(PartitionError, match="memory limit -0.5 is negative"):
        parse_bytes(-0.5)


@pytest.mark.parametrize("bad", ["16 parsecs", "GiB", "1.5.5GiB", "5.GiB", "-2GiB", "", True])
def test_parse_bytes_refuses(bad: object) -> None:
    with pytest.raises(PartitionError) as info:
        parse_bytes(bad)  # type: ignore[arg-type]
    assert str(info.value) == (f"cannot read memory size {bad!r}; use bytes or a number with a unit "
                               "like '16GiB', '512MB'")


@pytest.mark.parametrize(("n", "text"), [
    (None, "unlimited"), (0, "0 B"), (1023, "1023 B"), (1023.9, "1023 B"), (1024, "1.0 KiB"),
    (1536, "1.5 KiB"), (2**20 - 1, "1024.0 KiB"), (2**20, "1.0 MiB"), (2**30 - 2**19, "1023.5 MiB"),
    (2**30, "1.0 GiB"), (5 * 2**40, "5120.0 GiB"), (-2048, "-2.0 KiB"), (-5, "-5 B"),
])
def test_format_bytes(n: float | None, text: str) -> None:
    assert format_bytes(n) == text


def test_device_spec_refuses_a_speed_not_above_zero_and_negative_memory() -> None:
    assert DeviceSpec("d", 0, 0.5) == DeviceSpec(name="d", memory=0, speed=0.5)
    assert DeviceSpec("d").memory is None and DeviceSpec("d").speed == 1.0
    for speed in (0, -1.0, float("nan")):
        with pytest.raises(PartitionError) as info:
            DeviceSpec("d", speed=speed)
        assert str(info.value) == f"device 'd' has speed {speed}; speed must be > 0"
    with pytest.raises(PartitionError, match=r"^device 'd' has negative memory -1$"):
        DeviceSpec("d", -1)


def test_resolve_devices_from_a_stage_count() -> None:
    assert resolve_devices(2, None) == [DeviceSpec("stage0"), DeviceSpec("stage1")]
    assert resolve_devices(1, None, "1KiB") == [DeviceSpec("stage0", 1024)]
    with pytest.raises(PartitionError, match=r"^give stages=K or devices=\[\.\.\.\]: the number of stages is unknown$"):
        resolve_devices(None, None)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(PartitionError) as info:
            resolve_devices(bad, None)  # type: ignore[arg-type]
        assert str(info.value) == f"stages={bad!r}: need an integer K >= 1"


def test_resolve_devices_from_a_device_list() -> None:
    fast = DeviceSpec("b", 5000, 2.0)
    assert resolve_devices(None, ["a", fast]) == [DeviceSpec("a"), fast]
    assert resolve_devices(2, ("a", fast)) == [DeviceSpec("a"), fast]
    # a global limit fills the unlimited and caps the larger, keeping each speed
    assert resolve_devices(None, ["a", fast, DeviceSpec("c", 100)], 1000) == [
        DeviceSpec("a", 1000), DeviceSpec("b", 1000, 2.0), DeviceSpec("c", 100)]
    with pytest.raises(PartitionError, match=r"^devices=\[\] is empty: give at least one device$"):
        resolve_devices(None, [])
    with pytest.raises(PartitionError, match=r"^stages=3 but 2 devices given; drop one or make them agree$"):
        resolve_devices(3, ["a", "b"])


def test_the_precision_mismatch_line() -> None:
    from autopipe.core.planned_precision import precision_mismatch

    assert precision_mismatch("fp32", "fp32") is None
    assert precision_mismatch("fp32", "bf16") == (
        "the plan was measured under precision='fp32' but the pipeline computes in 'bf16': its "
        "predicted times and memory are fp32's; profile with precision='bf16' (autopipe profile "
        "--precision bf16) to plan for it")
