"""StepLimits: the first step's own limit, no limit, and bad limits ([Note: the first step's own
limit] in executor/ranks/watchdog.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from executor._torch_compat import set_group_timeout
from executor.errors import DistributedError
from executor.ranks.watchdog import FIRST_STEP_TIMEOUT_S, StepLimits


def test_the_first_step_gets_its_own_longer_limit_and_the_groups_are_made_for_it() -> None:
    limits = StepLimits(timeout=60.0)
    assert limits.first_step_timeout == FIRST_STEP_TIMEOUT_S
    assert (limits.step_limit(first=True), limits.step_limit(first=False)) == (FIRST_STEP_TIMEOUT_S, 60.0)
    assert limits.group_timeout == datetime.timedelta(seconds=FIRST_STEP_TIMEOUT_S)
    assert limits.steady_group_timeout == datetime.timedelta(seconds=60)
    # a first-step limit below the timeout never shortens the first step
    short = StepLimits(timeout=60.0, first_step_timeout=10.0)
    assert short.step_limit(first=True) == 60.0 and short.steady_group_timeout is None
    same = StepLimits(timeout=60.0, first_step_timeout=None)
    assert same.step_limit(first=True) == 60.0 and same.group_timeout == datetime.timedelta(seconds=60)


def test_timeout_none_turns_the_watchdog_off() -> None:
    off = StepLimits(timeout=None)
    assert off.step_limit(first=True) is None and off.step_limit(first=False) is None
    assert off.group_timeout is None and off.steady_group_timeout is None


@pytest.mark.parametrize("bad", [0, -1.0, "60", True, float("nan")])
@pytest.mark.parametrize("name", ["timeout", "first_step_timeout"])
def test_bad_limits_say_what_to_pass(name: str, bad: object) -> None:
    with pytest.raises(DistributedError, match=f"^{name}=.* must be a number of seconds > 0") as err:
        StepLimits(**{name: bad})  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_a_groups_timeout_is_shortened_after_the_first_step() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        assert set_group_timeout(group, datetime.timedelta(seconds=5)) is True
        backend = group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=5)
    finally:
        dist.destroy_process_group()
