"""The checkpoint flags of ``autopipe train`` and ``autopipe run``, and run's restarts: keyword-only
dataclass fields that config.py's TrainConfig and RunConfig inherit, so their defaults and help
are written once ([Note: one place for defaults] in config.py), with their one-line checks, run when a config is made ([Note: flags checked when made] in
flag_groups.py). What
they do is [Note: resuming a run] in autopipe/app/run_checkpoints.py. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopipe.app.flag_groups import Checked, flag
from autopipe.errors import BuildError

__all__ = ["CheckpointFlags", "RestartFlags", "check_checkpoints"]


@dataclass(frozen=True, kw_only=True)
class CheckpointFlags(Checked):
    checkpoint_dir: str | None = flag(
        None, "save checkpoints of the run (model, AdamW, step, RNG; through torch.distributed.checkpoint) "
              "in DIR/step-NNNNNNNN/, each renamed into place when whole; a DIR that already holds "
              "checkpoints is refused without --resume (default: none)", metavar="DIR")
    checkpoint_every: int | None = flag(
        None, "also save every N steps (default: only after the last step; needs --checkpoint-dir)", metavar="N")
    resume: bool = flag(False, "load the newest whole checkpoint in --checkpoint-dir (model, AdamW, step) "
                                "and train on from its step to --steps; refused when there is none or it "
                                "is another model's or optimizer's")
    keep: int | None = flag(None, "keep only the newest N checkpoints in --checkpoint-dir (default: all)",
                             metavar="N")

    def _check(self) -> None:
        check_checkpoints(self.checkpoint_dir, self.checkpoint_every, self.resume, self.keep)


@dataclass(frozen=True, kw_only=True)
class RestartFlags(CheckpointFlags):
    max_restarts: int = flag(0, "after a rank fails or hangs, restart every rank up to N times (torchrun's "
                                 "elastic agent); each restart resumes from the newest checkpoint in "
                                 "--checkpoint-dir, without one from step 1 (default 0)", metavar="N")

    def _check(self) -> None:  # CheckpointFlags' own _check ran first ([Note: flags checked when made])
        if self.max_restarts < 0:
            raise BuildError(f"--max-restarts {self.max_restarts} < 0: pass 0 (a failed rank ends the run) "
                             "or the number of restarts to allow")


def check_checkpoints(checkpoint_dir: str | None, every: int | None, resume: bool, keep: int | None) -> None:
    """--checkpoint-every, --resume and --keep need --checkpoint-dir and sensible counts."""
    if checkpoint_dir is None:
        given = [flag for flag, value in (("--checkpoint-every", every), ("--resume", resume or None),
                                          ("--keep", keep)) if value is not None]
        if given:
            raise BuildError(f"{given[0]} needs --checkpoint-dir DIR, the folder checkpoints are saved in "
                             "and resumed from; pass --checkpoint-dir")
    if every is not None and every < 1:
        raise BuildError(f"--checkpoint-every {every} < 1: save every N >= 1 steps, or drop it to save "
                         "after the last step only")
    if keep is not None and keep < 1:
        raise BuildError(f"--keep {keep} < 1: keep at least the newest checkpoint (--keep 1), or drop "
                         "--keep to keep all")
