"""A testing hook: ``AUTOPIPE_FAULT`` makes a rank of ``autopipe run`` die or hang on purpose,
so that tests can check what a failure and torchrun's restart do (tests/app/test_restart.py).

    AUTOPIPE_FAULT="rank=1,step=3,signal=KILL"                  # SIGKILL in rank 1's step 3
    AUTOPIPE_FAULT="rank=0,step=4,signal=KILL,when=save;rank=1,step=6,signal=STOP,attempt=1"

Each fault (``;`` between faults) acts once, on global rank ``rank``, in the attempt it names
(``attempt``: TORCHELASTIC_RESTART_COUNT, default 0, so that the restarted ranks run through):
``when=step`` (the default) sends ``signal`` (KILL or STOP) to the rank itself at its stage's
first forward of step ``step`` (1-based), while its peers are in that step with it;
``when=save`` sends it inside the checkpoint save after step ``step``, once this rank has
written its part of the checkpoint, before the save is whole. A bad value is one line naming
the variable. Without the variable nothing here runs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

from torch import nn

from autopipe.errors import BuildError

__all__ = ["ENV", "Fault", "Faults", "parse"]

ENV = "AUTOPIPE_FAULT"
_SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    signal: str = "KILL"
    when: str = "step"
    attempt: int = 0

    def fire(self) -> None:
        os.kill(os.getpid(), _SIGNALS[self.signal])


def parse(text: str) -> list[Fault]:
    """The faults ``text`` lists (see the module docstring); one line when malformed."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            fault = Fault(rank=int(fields.pop("rank")), step=int(fields.pop("step")),
                          signal=fields.pop("signal", "KILL").upper(), when=fields.pop("when", "step"),
                          attempt=int(fields.pop("attempt", "0")))
            if fields or fault.signal not in _SIGNALS or fault.when not in ("step", "save"):
                raise ValueError
        except (KeyError, ValueError):
            raise BuildError(f"{ENV}={text!r}: each fault is rank=R,step=S[,signal=KILL|STOP]"
                             "[,when=step|save][,attempt=A], faults separated by ';'") from None
        faults.append(fault)
    return faults


@dataclass(frozen=True)
class Faults:
    """The faults this rank acts on in this attempt."""

    faults: Sequence[Fault] = ()

    @classmethod
    def from_env(cls, rank: int, attempt: int) -> Faults:
        text = os.environ.get(ENV, "")
        return cls([f for f in parse(text) if f.rank == rank and f.attempt == attempt] if text else [])

    def _at(self, step: int, when: str) -> Fault | None:
        return next((f for f in self.faults if f.step == step and f.when == when), None)

    def during_step(self, step: int, stages: Sequence[nn.Module]) -> Any:
        """Around step ``step``: the fault that fires at this rank's first forward in it."""
        fault = self._at(step, "step")
        return nullcontext() if fault is None else _at_first_forward(fault, stages)

    def during_save(self, step: int) -> Any:
        """Around the save after step ``step``: the fault that fires once this rank's part is written."""
        fault = self._at(step, "save")
        return nullcontext() if fault is None else _after_writing(fault)


@contextmanager
def _at_first_forward(fault: Fault, stages: Sequence[nn.Module]) -> Iterator[None]:
    fired = False

    def once(*_: Any) -> None:  # a stopped rank continued (SIGCONT) runs on: not stopped again
        nonlocal fired
        if not fired:
            fired = True
            fault.fire()

    handles = [stage.register_forward_pre_hook(once) for stage in stages]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _after_writing(fault: Fault) -> Iterator[None]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_fail(self: Any, plan: Any, planner: Any) -> Any:
        written = write(self, plan, planner)
        written.wait()  # this rank's part is on disk; the save is not whole until every rank's is
        fault.fire()
        return written

    with mock.patch.object(FileSystemWriter, "write_data", write_then_fail):
        yield
