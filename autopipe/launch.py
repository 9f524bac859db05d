"""``autopipe run MODEL --nproc K``: train a bundled example as a K-process pipeline via torchrun.

    autopipe run mlp --plan plans/mlp.json --nproc 2 --steps 20

runs ``python -m torch.distributed.run --standalone --nproc_per_node K -m
autopipe.train_distributed MODEL ...`` (torchrun picks a free port and, when one rank fails,
stops the others) and returns its exit status. Each rank runs
:func:`autopipe.train_distributed.main`: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from autopipe.errors import BuildError
from autopipe.examples import EXAMPLES
from executor.distributed import SCHEDULES

__all__ = ["RunConfig", "torchrun_command", "run"]


@dataclass(frozen=True)
class RunConfig:
    """What every rank trains: an example, a plan (or None: rank 0 partitions), the loop."""

    model: str
    nproc: int = 2
    plan: str | None = None
    steps: int = 10
    batch_size: int = 32
    chunks: int | None = None  # default: the plan's, else 8
    schedule: str = "gpipe"
    checkpoint: str | None = None  # default: the plan's, else except_last
    lr: float = 1e-3
    timeout: float = 60.0
    threads: int = 1  # torch threads per rank

    def check(self) -> None:
        if self.model not in EXAMPLES:
            raise BuildError(f"unknown example {self.model!r}; `autopipe run` trains one of {sorted(EXAMPLES)}")
        if self.nproc < 1:
            raise BuildError(f"--nproc {self.nproc} < 1: a pipeline needs at least one process")
        if self.steps < 1:
            raise BuildError(f"--steps {self.steps} < 1: pass --steps 1 or more")
        if self.schedule not in SCHEDULES:
            raise BuildError(f"--schedule {self.schedule!r} is unknown; use one of {sorted(SCHEDULES)}")


def torchrun_command(config: RunConfig) -> list[str]:
    """The torchrun command line that runs ``config`` on ``config.nproc`` local processes."""
    config.check()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={config.nproc}", "-m", "autopipe.train_distributed", config.model,
           "--steps", str(config.steps), "--batch-size", str(config.batch_size),
           "--schedule", config.schedule, "--lr", str(config.lr), "--timeout", str(config.timeout),
           "--threads", str(config.threads)]
    for flag, value in (("--plan", config.plan), ("--chunks", config.chunks),
                        ("--checkpoint", config.checkpoint)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def run(config: RunConfig, *, extra_env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    """Run ``config`` under torchrun; the exit status (0 when every rank finished)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), **(extra_env or {})}
    try:
        return subprocess.run(torchrun_command(config), env=env, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"autopipe run: no result after {timeout:.0f}s; stopped torchrun", file=sys.stderr)
        return 124

