"""The README's two figures, regenerated from a committed profile::

    python -m autopipe.plot --readme-images            # -> docs/img/balance.png, timeline.png

balance.png is :func:`plot_balance` of autopipe's plan for ``profiles/cnn.csv`` (a ResNet-style
CNN with skips); timeline.png
puts the simulated GPipe iteration of the equal-layer-count split above autopipe's, on one
time axis, so the bubbles an unbalanced split costs are visible. Both are predictions from the
committed profile (no measurement), so the images change only when the profile or the code does.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.plot.balance import plot_balance
from autopipe.plot.plan_file import save_figure
from autopipe.plot.timeline import plot_timeline
from autopipe.solvers.partitioner import partition

__all__ = ["readme_images", "main"]


def readme_images(
    out_dir: str | os.PathLike[str] = "docs/img",
    *,
    profile: str | os.PathLike[str] = "profiles/cnn.csv",
    stages: int = 4,
    chunks: int = 4,
    force: bool = True,
) -> list[Path]:
    """Write ``balance.png`` and ``timeline.png`` into ``out_dir``; returns their paths."""
    prof = Profile.load(profile)
    model = prof.meta.get("model", Path(profile).stem)
    best = partition(prof, stages=stages, chunks=chunks, method="auto")
    uniform = partition(prof, stages=stages, chunks=chunks, method="uniform")
    out = Path(out_dir)
    balance = plot_balance(best, title=f"{model}: {stages} stages balanced by autopipe "
                                       f"({best.method}), {chunks} micro-batches")
    timeline = plot_timeline(
        simulate(uniform), simulate(best),
        labels=["equal layer counts (uniform)", f"autopipe ({best.method})"],
        title=f"{model}: one GPipe iteration, {stages} stages x {chunks} micro-batches (simulated)")
    return [save_figure(balance, out / "balance.png", force=force),
            save_figure(timeline, out / "timeline.png", force=force)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopipe.plot",
                                     description="regenerate the README figures")
    parser.add_argument("--readme-images", action="store_true", required=True,
                        help="write docs/img/balance.png and docs/img/timeline.png")
    parser.add_argument("--profile", default="profiles/cnn.csv")
    parser.add_argument("--out-dir", default="docs/img")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    for path in readme_images(args.out_dir, profile=args.profile, stages=args.stages,
                              chunks=args.chunks):
        print(f"wrote {path}")
    return 0
