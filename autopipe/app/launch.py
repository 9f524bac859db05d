"""``autopipe run MODEL --nproc K``: train a bundled example as a K-process pipeline via torchrun.

    autopipe run mlp --plan plans/mlp.json --nproc 2 --steps 20

runs ``python -m torch.distributed.run --standalone --nproc_per_node K -m
autopipe.app.rank_main --config JSON`` (torchrun picks a free port and, when one rank fails,
stops the others) and returns its exit status. Each rank runs
:func:`autopipe.app.rank_main.main`: gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

from autopipe.app.config import RunConfig

__all__ = ["torchrun_command", "run"]


def torchrun_command(config: RunConfig) -> list[str]:
    """The torchrun command line that runs ``config`` on ``config.nproc`` local processes."""
    config.check()
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={config.nproc}", "-m", "autopipe.app.rank_main",
            "--config", config.to_json()]


def run(config: RunConfig, *, extra_env: dict[str, str] | None = None, timeout: float | None = None) -> int:
    """Run ``config`` under torchrun; the exit status (0 when every rank finished)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), **(extra_env or {})}
    try:
        return subprocess.run(torchrun_command(config), env=env, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        print(f"autopipe run: no result after {timeout:.0f}s; stopped torchrun", file=sys.stderr)
        return 124

