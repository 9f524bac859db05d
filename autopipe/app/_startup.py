"""The start of a process that autopipe launches (a rank of ``autopipe run`` or ``autopipe comm``).

[Note: a rank's imports without the collector] A rank is a new interpreter that imports torch,
torch.distributed.pipelining (which imports torch._dynamo, FSDP and DTensor) and autopipe:
hundreds of thousands of objects, over which CPython's cyclic collector keeps running while
they are made, though almost none is garbage. So a rank imports them with the collector paused
(:func:`collector_paused`), and, once they are imported, freezes them (``gc.freeze()``: they move
to a permanent generation that later collections do not walk). Pausing alone saves little:
most of the saving is at exit, whose collections no longer walk the imports' objects once they
are frozen. Every rank of every attempt pays the imports, a restart after a failed rank
included (measured: CHANGELOG.md, "Ranks that start sooner"; docs/benchmarks.md, "Figures
behind the Notes"). The imports leave some thousands of unreachable objects (megabytes, no
more) that are never freed, and a full collection during training walks only what training
made (over the imports' objects it would take a sizeable fraction of a second, on one rank
while the others wait at its next send). The suite's forked processes and its workers'
collection do the same (tests/forked_preload.py, tests/conftest.py).

Both are process-wide, so only a rank's own ``__main__`` does them (autopipe/app/rank_main.py,
autopipe/app/comm_job.py): importing those modules from elsewhere (a test, a user's script)
pauses the collector for their imports only and leaves it as it was; the library never does.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "freeze_imports"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside the block, then as it was before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_imports() -> None:
    """Move every object alive now (what the rank imported) out of the collector's reach
    ([Note: a rank's imports without the collector]). Called by a rank's ``__main__`` only."""
    gc.freeze()
