from __future__ import annotations

import pytest

from autopipe.core.units import format_bytes, parse_bytes
from autopipe.errors import PartitionError


def test_parse_and_format_bytes() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5 kib") == 1536
    assert parse_bytes(1000) == 1000 and parse_bytes(None) is None
    assert format_bytes(3 * 2**30) == "3.0 GiB" and format_bytes(None) == "unlimited"
    with pytest.raises(PartitionError, match="cannot read memory size '16 parsecs'"):
        parse_bytes("16 parsecs")
    with pytest.raises(PartitionError, match="negative"):
        parse_bytes(-1)
