"""The start of a process that autopipe launches (a rank of ``autopipe run`` or ``autopipe comm``).

[Note: a rank's imports without the collector] A rank is a new interpreter that imports torch,
torch.distributed.pipelining (which imports torch._dynamo, FSDP and DTensor) and autopipe: about
500,000 objects, over which CPython's cyclic collector keeps running while they are made, though
almost none is garbage. So a rank imports them with the collector paused
(:func:`collector_paused`), and, once they are imported, freezes them (``gc.freeze()``: they move
to a permanent generation that later collections do not walk). Measured on the 2-core CI machine
(torch 2.13, CPU), seven interleaved runs of importing ``autopipe.app.rank_main`` and exiting: a
median 4.4 s of CPU as before, 4.3 s with the collector paused alone, 3.0 s paused and frozen
(most of the saving is at exit, whose collections no longer walk the imports' objects). Every
rank of every attempt pays it, a restart after a failed rank included. The imports leave about
9,000 unreachable objects (under 10 MB) that are never freed, and a full collection during
training walks only what training made (over the imports' objects it takes 0.3 s, on one rank
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
