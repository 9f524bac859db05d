"""Figures that show a pipeline's balance: matplotlib, no display needed, no pyplot state.

    fig = autopipe.plot_balance(plan)                  # per-stage time and memory
    fig = autopipe.plot_profile(profile, plan)         # per-layer costs with the plan's cuts
    fig = autopipe.plot_timeline(simulate(plan), events)  # predicted over measured Gantt chart
    fig = autopipe.compare_plans({"dp": p1, "uniform": p2})
    fig.savefig("balance.png")                         # or autopipe.plot.save_figure(fig, path)

Each function is pure: it reads its arguments and returns a new ``matplotlib.figure.Figure``
(see [Note: figures without pyplot] in autopipe.plot.style).

    style.py      phase colours, byte units, argument checks
    balance.py    plot_balance, compare_plans
    per_layer.py  plot_profile
    timeline.py   plot_timeline, bubble_fraction
    plan_file.py  save_figure, plot_plan_file (the ``autopipe plot`` command)
    readme.py     the README images (``python -m autopipe.plot --readme-images``)
    __main__.py   ``python -m autopipe.plot``: runs readme.py's main
"""

from __future__ import annotations

from autopipe.plot.balance import compare_plans, plot_balance
from autopipe.plot.per_layer import plot_profile
from autopipe.plot.plan_file import FIGURES, plot_plan_file, save_figure
from autopipe.plot.timeline import bubble_fraction, plot_timeline

__all__ = [
    "plot_balance",
    "plot_profile",
    "plot_timeline",
    "compare_plans",
    "bubble_fraction",
    "save_figure",
    "plot_plan_file",
    "FIGURES",
]
