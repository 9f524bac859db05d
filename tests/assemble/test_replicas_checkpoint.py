"""Resume, exactly, with replicas: 2 replicas x 2 stages (DDP, FSDP) on 4 gloo ranks.

One spawn of 4 ranks runs every case in turn (starting 4 processes costs more than a case;
the runs as tests/assemble/test_ranks_checkpoint.py's ``_run``, each model traced once per rank
and mode of dropout). Under DDP with dropout: 6
steps straight vs 3, save, a new pipeline and optimizer, load, 3 more, bit for bit. With
dropout off (p=0: masks drawn under another plan differ): a DDP checkpoint resumed under FSDP
and under one pipeline of 4 stages (another K and D), an FSDP one (sharded parameters and AdamW
states, saved mid-run) under DDP and into the plain model, each close to the plain model's 6
steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from tests import resume_cases as rc
from tests.assemble.test_ranks import _ok, spawn
from tests.assemble.test_ranks_checkpoint import _plain, _run, assert_equal, assert_matches


def _ranks(rank: int, root: str, plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Tensor]]:
    """Every case on one rank, in turn. The straight runs save at step 3 on their way (async:
    the steps after it must not reach the checkpoint), which costs a pipeline less each."""
    ddp, fsdp, at = plans["ddp"], plans["fsdp"], rc.SAVED_AT
    traces: rc.Traces = {}  # this rank's: each model traced once per mode of dropout
    out = {"straight": _run(rank, ddp, rc.DROPOUT, 0, rc.STEPS, save=f"{root}/dropout", save_at=at,
                            async_save=True, traces=traces)}
    out["resumed"] = _run(rank, ddp, rc.DROPOUT, at, rc.STEPS, load=f"{root}/dropout", traces=traces)
    _run(rank, ddp, 0.0, 0, at, save=f"{root}/ddp", traces=traces)
    out["fsdp"] = _run(rank, fsdp, 0.0, 0, rc.STEPS, save=f"{root}/fsdp", save_at=at, async_save=True,
                       traces=traces)
    out["ddp_to_fsdp"] = _run(rank, fsdp, 0.0, at, rc.STEPS, load=f"{root}/ddp", traces=traces)
    out["fsdp_to_ddp"] = _run(rank, ddp, 0.0, at, rc.STEPS, load=f"{root}/fsdp", traces=traces)
    out["ddp_to_k4"] = _run(rank, plans["k4"], 0.0, at, rc.STEPS, load=f"{root}/ddp", traces=traces)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_with_replicas(tmp_path: Path) -> None:
    traces: rc.Traces = {}
    plans = {"ddp": rc.plan(2, 2, "ddp", traces=traces), "fsdp": rc.plan(2, 2, "fsdp", traces=traces),
             "k4": rc.plan(4)}
    ranks = _ok(spawn(_ranks, str(tmp_path), plans, world=4, timeout=200))
    for r, values in enumerate(ranks):
        assert_equal(values["resumed"], values["straight"], f"rank {r} resumed under DDP")
    expected = rc.reference()
    for case in ("fsdp", "ddp_to_fsdp", "fsdp_to_ddp", "ddp_to_k4"):
        assert_matches([v[case] for v in ranks], expected, case)
    assert_matches([_plain("tiny", rc.SAVED_AT, rc.STEPS, load=tmp_path / "fsdp")], expected,
                   "FSDP -> the plain model")
