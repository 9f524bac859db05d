"""Flag groups that several commands share: one keyword-only dataclass per component, composed
into each command's config (config.py), after torchtitan's config/configs.py. Each field's
default and help are written once, each group's values checked once, when the config is made
([Note: flags checked when made]). Imports no torch.

    Checked         the base of every group and config: runs each class's own ``_check``
    PrecisionFlags  --precision, --host-allocator: what the stages compute in, host memory
                    (profile, train, run)
    LoopFlags       --steps, --lr, --clip-grad: the training loop (train, run)
    MeshFlags       --data-parallel, --dp-mode, --tensor-parallel, --devices-per-host: the
                    devices as PP x TP x DP (partition)
    CheckpointFlags, RestartFlags (checkpoint_flags.py): saved training state and restarts
    Launch (config.py): where the ranks of ``run`` and ``comm`` run

[Note: flags checked when made] A command's config is made once, from the command line
(flags.from_namespace) or from JSON on a rank, and may be remade by ``dataclasses.replace``. So
the checks live in ``__post_init__``: a config in hand is a valid one, and no caller can forget
to check it. Each group and each command checks only its own fields, in a ``_check`` method of
its own class; ``Checked.__post_init__`` runs every class's ``_check`` once, bases first, so a
command composed of groups checks each group exactly once. A bad value is one BuildError line
naming the flag, which the command line prints with exit status 2.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from autopipe.errors import BuildError, PartitionError
from executor.spec import PRECISIONS

__all__ = ["Checked", "PrecisionFlags", "LoopFlags", "MeshFlags", "count_or_auto", "Precision", "HostAllocator", "check_choice",
           "check_clip_grad", "flag", "positional"]

Precision = Literal["fp32", "bf16", "fp16"]
HostAllocator = Literal["retain", "system"]
assert typing.get_args(Precision) == PRECISIONS, "--precision's choices are executor.spec.PRECISIONS"


def flag(default: Any, help: str, **meta: Any) -> Any:
    """A flag ``--name`` (from the field's name) with ``default`` and ``help``."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def positional(help: str, **meta: Any) -> Any:
    """A positional argument."""
    return field(metadata={"help": help, "positional": True, **meta})


class Checked:
    """Runs each class's own ``_check`` once, bases first ([Note: flags checked when made])."""

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)


def check_choice(flag: str, value: Any, kind: Any) -> None:
    """``value`` is one of the Literal ``kind``'s choices: one line naming them otherwise."""
    choices = typing.get_args(kind)
    if value not in choices:
        raise BuildError(f"{flag} {value!r} is unknown; use one of {list(choices)}")


def check_count(flag: str, value: int | None) -> None:
    """A count flag (repeats, chunks, threads ...) is 1 or more, or absent: one line otherwise."""
    if value is not None and value < 1:
        raise BuildError(f"{flag} {value} < 1: pass {flag} 1 or more")


def check_clip_grad(clip_grad: float | None) -> None:
    """--clip-grad is a positive norm (or absent): one line otherwise."""
    if clip_grad is not None and not clip_grad > 0:
        raise BuildError(f"--clip-grad {clip_grad} must be > 0 (the largest gradient norm a step "
                         "keeps), e.g. --clip-grad 1.0")


@dataclass(frozen=True, kw_only=True)
class PrecisionFlags(Checked):
    precision: Precision = flag(
        "fp32", "fp32, or bf16 / fp16: autocast in every stage over fp32 parameters, gradients and "
                "optimizer state; a profile is measured under it and records it, partition plans "
                "for it, fp16 trains through torch.amp.GradScaler and ranks reduce gradients in "
                "fp32 (default fp32)")
    host_allocator: HostAllocator = flag(
        "retain", "on a CPU, retain: glibc keeps freed memory for reuse, as a training loop reuses "
                  "it (default); system: the allocator as it is. The profile records it")

    def _check(self) -> None:  # --host-allocator: the library's own one-line check
        check_choice("--precision", self.precision, Precision)


@dataclass(frozen=True, kw_only=True)
class LoopFlags(Checked):
    steps: int = flag(10, "training steps (default 10; the summary times steps 2 on)")
    lr: float = flag(1e-3, "AdamW learning rate (default 0.001)")
    clip_grad: float | None = flag(
        None, "clip the gradient norm of the whole model (every stage, each parameter once) to "
              "this before each step (default: no clipping)", metavar="MAX_NORM")

    def _check(self) -> None:
        check_count("--steps", self.steps)
        check_clip_grad(self.clip_grad)


def count_or_auto(flag: str, value: str) -> int | str:
    """``auto`` or a whole number >= 1, else one line naming the flag."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise PartitionError(f"{flag} {value!r}: give a whole number >= 1 or auto")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class MeshFlags(Checked):
    data_parallel: str = flag("1", "replicas D of the pipeline, each on N / D of --devices and "
                                   "B / D rows of --batch-size, or auto: the divisor of N with the "
                                   "fastest simulated step (default 1)", metavar="D|auto")
    dp_mode: Literal["ddp", "fsdp"] = flag("ddp", "how replicas sync: ddp (gradient all-reduce) "
                                                  "or fsdp (sharded state) (default ddp)")
    tensor_parallel: str = flag("1", "TP degree T: each stage's layers split over T devices of one "
                                     "host (the column / row Linears and the vocabulary the profile "
                                     "found); --devices = stages x T x replicas; or auto: the degree "
                                     "with the fastest simulated step (default 1)", metavar="T|auto")
    sequence_parallel: bool = flag(False, "with --tensor-parallel T: also split the layers between its "
                                          "groups (norms, residual adds) by tokens over the T devices, "
                                          "Megatron's sequence parallelism (tokens divisible by T)")
    devices_per_host: int | None = flag(None, "devices one host holds; a TP group stays inside one "
                                              "(default 8 for a profile estimated on a GPU sheet, "
                                              "else every device on one host)")

    def _check(self) -> None:  # --data-parallel and --dp-mode: the config's and partition()'s checks
        count_or_auto("--tensor-parallel", self.tensor_parallel)
        check_count("--devices-per-host", self.devices_per_host)
