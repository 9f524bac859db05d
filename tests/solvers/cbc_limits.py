"""The time limits the ILP hands to CBC, recorded; and a limit CBC always overruns, so that a
test of what a solve stopped on time reports does not depend on how fast the host runs CBC."""

from __future__ import annotations

from typing import Any

import pulp
import pytest

OVERRUN_S = 0.001
"""Less than CBC takes to read any model: CBC exits at its first look at the clock, after the
continuous relaxation and the warm start (its log's ``Cbc0020I Exiting on maximum time``), the
same point on an idle or a loaded host."""


def record_cbc_limits(monkeypatch: pytest.MonkeyPatch, overrun: bool = False) -> list[tuple[float, str]]:
    """Each CBC run's ``(timeLimit, timeMode)`` as PuLP passes them (``-sec``, ``-timeMode``),
    appended as CBC starts; with ``overrun`` CBC then runs with ``OVERRUN_S`` instead."""
    seen: list[tuple[float, str]] = []
    solve = pulp.LpProblem.solve

    def recorded(self: pulp.LpProblem, solver: Any = None, **kwargs: Any) -> Any:
        assert solver is not None, "the ILP names its CBC command"
        seen.append((solver.timeLimit, solver.optionsDict.get("timeMode")))
        if overrun:
            solver.timeLimit = OVERRUN_S
        return solve(self, solver, **kwargs)

    monkeypatch.setattr(pulp.LpProblem, "solve", recorded)
    return seen
