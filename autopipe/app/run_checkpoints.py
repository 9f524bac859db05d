"""Checkpoints of ``autopipe train`` and ``autopipe run``: when to save, what a resume loads,
and the line that says where a run resumed and which steps it runs again.

[Note: resuming a run] ``--checkpoint-dir DIR`` saves the pipeline and its AdamW after the last
step (and every ``--checkpoint-every N`` steps) with ``pipe.save_checkpoint`` (executor/
recompute: every rank its part, the folder renamed into place only when whole). A run resumes
from the newest whole checkpoint in DIR when it is asked to (``--resume``) or when torchrun's
elastic agent has restarted the ranks after a failure (``TORCHELASTIC_RESTART_COUNT`` > 0,
``autopipe run --max-restarts N``), and trains on to ``--steps``. Because each step's batch is
a function of the step alone ([Note: a batch per step] in autopipe/examples.py) and the
checkpoint holds the parameters, AdamW's state and every rank's RNG, the resumed run computes
what the uninterrupted one would, bit for bit under the same plan.

Nothing saved is overwritten: a fresh start (no ``--resume``, no restart) on a DIR that holds
checkpoints is refused before anything runs (:func:`check_before_start`). Rank 0 also notes
the step it is running in ``DIR/autopipe-progress.json``, so that a resumed run can say which
steps it runs again: those after the checkpoint's step up to the step the failed run reached.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopipe.errors import BuildError
from executor.checkpoint import Checkpointable, check_checkpoint
from executor.checkpoint.folders import committed_steps

__all__ = ["PROGRESS", "RunCheckpoints", "check_before_start", "refuse_overwrite", "nothing_left",
           "restart_count"]

PROGRESS = "autopipe-progress.json"


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this rank's group (0: first run)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def check_before_start(checkpoint_dir: str | None, resume: bool, model: nn.Module) -> int | None:
    """Before any training: refuse a fresh start on a DIR that holds checkpoints; with
    ``resume``, check the newest one against ``model`` and AdamW (CheckpointError's line when it
    does not fit) and return its step. None: the run starts at step 0."""
    if checkpoint_dir is None:
        return None
    if not resume:
        refuse_overwrite(Path(checkpoint_dir))
        return None
    info = check_checkpoint(checkpoint_dir, model, torch.optim.AdamW(model.parameters()))
    return int(info["step"])


def refuse_overwrite(folder: Path) -> None:
    """One line when ``folder`` holds checkpoints that a fresh start would mix with its own."""
    held = committed_steps(folder)
    if held:
        raise BuildError(f"--checkpoint-dir {folder} already holds {len(held)} checkpoint(s) (newest "
                         f"{held[-1][1].name}); pass --resume to train on from it, or another "
                         "--checkpoint-dir (nothing saved is overwritten)")


def nothing_left(prog: str, folder: str, step: int, steps: int) -> str:
    return (f"{prog}: {folder} is at step {step} of --steps {steps}: nothing left to train (pass a "
            "larger --steps to train on)")


@dataclass(frozen=True)
class RunCheckpoints:
    """Where and when a run saves, and whether it starts from the newest checkpoint."""

    folder: Path
    every: int | None = None
    keep: int | None = None
    resume: bool = False  # --resume, or an elastic restart
    prog: str = "autopipe run"  # the command, in the lines it prints

    @classmethod
    def of(cls, checkpoint_dir: str | None, every: int | None, keep: int | None, resume: bool,
           prog: str) -> RunCheckpoints | None:
        if checkpoint_dir is None:
            return None
        return cls(Path(checkpoint_dir), every, keep, resume, prog)

    def due(self, done: int, steps: int) -> bool:
        """Whether to save after ``done`` steps of ``steps``."""
        return done == steps or (self.every is not None and done % self.every == 0)

    def started(self, step: int) -> None:
        """Note that ``step`` (1-based) is being run (call it on one rank)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        scratch = self.folder / (PROGRESS + ".tmp")
        scratch.write_text(json.dumps({"step": step}), encoding="utf-8")
        os.replace(scratch, self.folder / PROGRESS)

    def reached(self) -> int | None:
        """The last step a run in this folder started (None: not known)."""
        try:
            step = json.loads((self.folder / PROGRESS).read_text(encoding="utf-8"))["step"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return step if isinstance(step, int) else None

    def save(self, pipe: Checkpointable, optimizer: torch.optim.Optimizer, step: int, extra: Any) -> Path:
        """Save after ``step`` steps (a collective on ranks); the checkpoint's folder."""
        return pipe.save_checkpoint(self.folder, optimizer, extra=extra, step=step, keep=self.keep).wait()

    def load(self, pipe: Checkpointable, optimizer: torch.optim.Optimizer, steps: int,
             restart: int = 0) -> tuple[int, dict[str, Any], str]:
        """Resume ``pipe`` and ``optimizer`` when asked to: the step to start from, the
        checkpoint's ``extra`` and the line that says where the run resumed and which steps it
        runs again ("" for a fresh start). A fresh start on a folder of checkpoints is refused."""
        who = f"{self.prog}: restart {restart}" if restart else self.prog
        before = "the failed run" if restart else "the run before"
        reached = self.reached()
        if not self.resume:
            refuse_overwrite(self.folder)
            return 0, {}, ""
        if restart and not committed_steps(self.folder):  # it failed before its first save
            again = f"; steps 1..{reached} run again ({reached} redone)" if reached else ""
            return 0, {}, f"{who}: no checkpoint in {self.folder} yet, starting again from step 1{again}"
        saved = pipe.load_checkpoint(self.folder, optimizer)
        extra = saved if isinstance(saved, dict) else {}
        step, folder = pipe.steps, committed_steps(self.folder)[-1][1]
        if step >= steps:
            return step, extra, nothing_left(who, str(folder), step, steps)
        line = f"{who}: resumed from {folder} at step {step} of {steps}"
        if reached is not None and reached > step:
            runs = f"step {reached} runs" if reached == step + 1 else f"steps {step + 1}..{reached} run"
            line += f"; {before} had reached step {reached}: {runs} again ({reached - step} redone)"
        else:
            line += "; no step is redone"
        unfinished = sorted(p.name for p in self.folder.glob("step-*.partial") if p.is_dir())
        if unfinished:
            line += f" ({', '.join(unfinished)}: a save that did not finish, ignored)"
        return step, extra, line
