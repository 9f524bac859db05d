"""Figures to files: ``save_figure`` and ``plot_plan_file`` (what ``autopipe plot`` runs).

Saving never needs a display: a pyplot-free Figure renders through Agg (see [Note: figures
without pyplot] in autopipe.plot.style). An existing file is never replaced unless asked, and a
figure is written to a temporary file first, so a failure leaves no half-written image.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from matplotlib.figure import Figure

from autopipe.core.atomic_files import atomic_write
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.errors import PlotError
from autopipe.plot.balance import plot_balance
from autopipe.plot.per_layer import plot_profile
from autopipe.plot.timeline import plot_timeline

__all__ = ["FIGURES", "save_figure", "plot_plan_file"]

FIGURES: tuple[str, ...] = ("balance", "layers", "timeline")


def save_figure(fig: Figure, out: str | os.PathLike[str], *, force: bool = False,
                dpi: int = 120) -> Path:
    """Write ``fig`` to ``out`` (format from the suffix: .png, .svg, .pdf, ...).

    Refuses to replace an existing file unless ``force``; creates missing parent folders.
    """
    path = _check_out(out, force)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=path.suffix[1:].lower()))
    return path


def plot_plan_file(
    plan: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    profile: str | os.PathLike[str] | None = None,
    figure: str = "balance",
    schedule: str | None = None,
    force: bool = False,
) -> Path:
    """Draw a saved plan and write the image: ``autopipe plot PLAN --out FILE``.

    figure: ``balance`` (:func:`plot_balance`), ``layers`` (:func:`plot_profile` with the
    plan's cuts; needs ``profile``) or ``timeline`` (the simulated ``schedule``, default the
    plan's own). With a
    ``profile`` the plan is checked against it and its stage costs are recomputed from it.
    Raises PlotError, PlanError or ProfileError with a one-line reason.
    """
    if figure not in FIGURES:
        raise PlotError(f"figure={figure!r} is unknown; choose one of {list(FIGURES)}")
    _check_out(out, force)  # before any work: fail fast
    loaded = Plan.load(plan)
    prof = None if profile is None else Profile.load(profile)
    if prof is not None:
        loaded = dataclasses.replace(Plan.from_stages(  # one rank's costs: [Note: the mesh]
            loaded.profile_for(prof), loaded.stages, devices=loaded.devices, chunks=loaded.chunks,
            recompute=loaded.recompute, optimizer=loaded.optimizer, bandwidth=loaded.bandwidth,
            ties=loaded.ties, method=loaded.method, solver=loaded.solver,
            schedule=loaded.schedule, alternatives=loaded.alternatives,
            data_parallel=loaded.data_parallel, dp_mode=loaded.dp_mode,
            recompute_layers=loaded.recompute_layers, merge_backward=loaded.merge_backward),
            tensor_parallel=loaded.tensor_parallel)
    if figure == "balance":
        fig = plot_balance(loaded)
    elif figure == "layers":
        if prof is None:
            raise PlotError("the layers figure draws a profile: pass --profile profiles/NAME.csv")
        fig = plot_profile(prof, loaded)
    else:
        from autopipe.core.simulator import simulate

        result = simulate(loaded, prof, schedule=schedule)
        fig = plot_timeline(result.timeline, labels=[f"predicted ({result.schedule})"])
    return save_figure(fig, out, force=force)


def _check_out(out: str | os.PathLike[str], force: bool) -> Path:
    path = Path(out)
    kinds = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in kinds:
        raise PlotError(f"cannot write {path}: unknown image type {path.suffix or '(none)'!r}; "
                        f"end the name with one of {sorted('.' + k for k in kinds)[:8]}")
    if path.is_dir():
        raise PlotError(f"{path} is a directory; give a file name such as {path / 'balance.png'}")
    if path.exists() and not force:
        raise PlotError(f"{path} already exists: refusing to overwrite it; pass --force / force=True "
                        f"or choose another name")
    return path
