"""A peer rank's failure, seen from this rank: one exception naming the rank, step and cause.

[Note: a dead rank is an error, not a hang] Gloo may wait for a dead or stuck peer for the
whole process-group timeout (30 minutes by default), or forever (pytorch#132644). The
distributed pipeline (executor/ranks/distributed.py) therefore talks on its own process group created
with ``timeout``, turns any communication error into :class:`PipelineFailure` naming the rank,
step and schedule (:func:`peer_failures`), and arms a watchdog per step: if a step overruns
``timeout`` plus a grace period the watchdog prints the same kind of one-line error and ends the
process with ``os._exit`` and exit status 3 (executor.ranks.watchdog.WATCHDOG_EXIT_CODE), as torch's
NCCL watchdog does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: a hung step cannot be unwound from
another thread. Peers then see the connection drop and fail too. The first step has its own,
longer limit ([Note: the first step's own limit] in executor/ranks/watchdog.py); ``timeout=None``
turns the watchdog off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from executor._torch_compat import is_communication_error

__all__ = ["PipelineFailure", "peer_failures"]


class PipelineFailure(RuntimeError):
    """A peer rank died, hung or failed mid-step (a runtime fault, not bad input)."""


@contextmanager
def peer_failures(describe: Callable[[str], str]) -> Iterator[None]:
    """A communication error is a peer's failure: PipelineFailure(``describe(cause)``). A stage's
    own one-line error on bad input (a ValueError: the traced graph's input or mode check) is
    raised as itself, not inside the multi-line RuntimeError PipelineStage wraps it in."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err.__cause__, ValueError):
            raise err.__cause__ from None
        # PipelineStage wraps errors of a stage's forward (DDP's collectives) in its own
        peer = next((e for e in (err, err.__cause__) if e is not None and is_communication_error(e)), None)
        if peer is None:
            raise  # this rank's own bug (a shape error, out of memory): not a peer's fault
        raise PipelineFailure(describe(str(peer).strip().splitlines()[0])) from err
