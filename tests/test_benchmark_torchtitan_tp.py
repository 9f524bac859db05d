"""benchmarks/torchtitan_tp.py on a hand-made profile (eight blocks of a column / sharded / row
group, tests/solvers/test_tensor_parallel_search.py) in place of the 405B estimate: torchtitan's
405B mesh (512 GPUs, FSDP 8 x TP 8 x PP 8) evaluated, autopipe's meshes up to 2 stages planned.
What it checks is the table's own arithmetic: autopipe's row is the fastest mesh it planned,
torchtitan's rows their published mesh."""

from __future__ import annotations

import re
from typing import Any

import pytest

from benchmarks import torchtitan_tp
from tests.solvers.test_tensor_parallel_search import _blocks


def test_the_mesh_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchtitan_tp, "estimated", lambda *args: _blocks(8))
    rows: list[Any] = torchtitan_tp.main(["--shape", "405b", "--most-stages", "2"])
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]
    assert [c[0] for c in cells] == ["torchtitan's, 1f1b", "torchtitan's, interleaved1f1b", "autopipe's"]
    assert cells[0][1] == "PP 8 x TP 8 x DP 8 (8 stages)" and cells[1][1] == "PP 8 x TP 8 x DP 8 (16 stages)"
    # no named blocks in this profile: every layer but the last, alone, one segment a stage
    assert cells[0][2].endswith("39 layers recomputed in 8 segments")
    err = capsys.readouterr().err
    planned = [float(s) for s in re.findall(r"PP \d+ x TP \d+ x DP \d+, \w+: ([\d.]+) s,", err)]
    assert planned and float(cells[2][3]) == min(planned)  # both printed to the hundredth of a second
