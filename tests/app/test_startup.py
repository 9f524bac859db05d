"""A rank's imports without the collector ([Note: a rank's imports without the collector] in
autopipe/app/_startup.py): paused for the imports only, and frozen by a rank's __main__ alone."""

from __future__ import annotations

import gc
import importlib
import sys

import pytest

from autopipe.app._startup import collector_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_inside_and_as_it_was_after(enabled: bool) -> None:
    before = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError, match="inside"), collector_paused():
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if before else gc.disable)()


@pytest.mark.parametrize("module", ["autopipe.app.rank_main", "autopipe.app.comm_job"])
def test_importing_a_rank_module_changes_nothing_process_wide(module: str) -> None:
    """A test or a user's script importing a rank's module: the collector still runs and
    nothing is frozen (only ``python -m`` of the module, a rank, freezes its imports)."""
    old = sys.modules.pop(module, None)
    frozen = gc.get_freeze_count()
    try:
        importlib.import_module(module)
        assert gc.isenabled()
        assert gc.get_freeze_count() <= frozen  # freed ones leave it; a freeze would add every object
    finally:
        if old is not None:
            sys.modules[module] = old
