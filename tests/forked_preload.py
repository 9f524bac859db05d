"""What the server of tests/forked.py imports before its first fork: ``PRELOAD``, with the cyclic
collector paused, then frozen ([Note: a rank's imports without the collector] in
autopipe/app/_startup.py), so that the server imports sooner and no child's collections walk
(and copy, page by page, out of the server's memory) the objects every child inherits."""

from __future__ import annotations

import gc
import importlib

from autopipe.app._startup import collector_paused

with collector_paused():
    from tests.forked import PRELOAD

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a family this transformers lacks: skipped, as the server would
            pass
gc.freeze()
