"""Resume, exactly: 6 steps straight vs 3, save, a new pipeline and optimizer, load, 3 more.

AdamW with a StepLR on tiny LMs whose heads are tied to their embeddings across the 2 ranks
(tests/resume_cases.py). One call of the pool's 2 ranks ([Note: one pool of ranks]) runs every
case in turn; this process runs the one-process ends (GPipe, the plain model) around it. One
save is async, the run going on (and running a collective of its own) until it is waited for.
Each model is traced once per process and mode of dropout, its pipelines built on deep copies of
it and its graph (``resume_cases.traced``): the runs are about checkpoints, not tracing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import autopipe
from autopipe.assemble.ranks import distributed_pipeline
from autopipe.core.plan import Plan
from executor.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from tests import resume_cases as rc
from tests.assemble.test_ranks import _close, _ok, spawn


def _run(rank: int, plan: dict[str, Any], dropout: float, start: int, stop: int, *,
         load: str | None = None, save: str | None = None, save_at: int | None = None,
         async_save: bool = False, case: str = "tiny", traces: rc.Traces | None = None) -> dict[str, Tensor]:
    """Steps [start, stop) on a new pipeline of ``plan``, loaded from ``load`` first, saved to
    ``save`` after step ``save_at`` (default: the last). An async save is waited for only at the
    end: the steps after it change every tensor it saves, and a collective on the default group
    (as a training loop's logging would run) goes on meanwhile. ``traces``: the model's trace
    from an earlier run of the call (``resume_cases.traced``)."""
    made = Plan.from_dict(plan)
    replicas = made.data_parallel  # every replica's batch has the shape of replica 0's
    model, graph = rc.traced({} if traces is None else traces, dropout, case, replicas)
    pipe = distributed_pipeline(model, rc.batch(0, 0, replicas)[:1], loss_fn=rc.lm_loss,
                                plan=made, timeout=20, graph=graph)
    opt, scheduler = rc.optimizer(pipe.stage_module.parameters())
    torch.manual_seed(1000 + rank)  # dropout's draws (a resumed run's: its checkpoint's)
    if load is not None:
        assert pipe.load_checkpoint(load, opt, scheduler) == {"at": start}
        assert pipe.steps == start

    def step(n: int) -> None:
        x, y = rc.batch(n, pipe.dp_rank, replicas)
        pipe.step(x, target=y)

    saving = None
    for n in range(start, stop):
        rc.train_steps(step, opt, scheduler, n, n + 1)
        if save is not None and n + 1 == (stop if save_at is None else save_at):
            saving = pipe.save_checkpoint(save, opt, scheduler, extra={"at": n + 1}, async_save=async_save)
            if async_save:  # not on the save's group: this would hang both ranks
                logged = torch.ones(1)
                dist.all_reduce(logged)
                assert logged.item() == dist.get_world_size()
    if saving is not None:
        assert saving.wait().name == f"step-{save_at or stop:08d}"
    return rc.pipeline_state(pipe, opt)


def _ranks(rank: int, root: str, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every case of this module on one rank, in turn; and the GPT-2 plan, made here from this
    rank's own trace (as the parent's plans are made: every rank makes the same), which spares
    the parent a trace of its own."""
    k2, k4, at = plans["k2"], plans["k4"], rc.SAVED_AT
    traces: rc.Traces = {}  # this call's: each model traced once per mode of dropout
    # the straight run saves on its way (async: its next steps must not reach the checkpoint),
    # one pipeline less; the resumed one loads the root, whole on every rank once wait() returned
    out = {"straight": _run(rank, k2, rc.DROPOUT, 0, rc.STEPS, save=f"{root}/dropout", save_at=at,
                            async_save=True, traces=traces)}
    out["resumed"] = _run(rank, k2, rc.DROPOUT, at, rc.STEPS, load=f"{root}/dropout", traces=traces)
    _run(rank, k2, 0.0, 0, at, save=f"{root}/ranks", traces=traces)  # for this process: GPipe, the plain model
    out["other_k"] = _run(rank, k4, 0.0, at, rc.STEPS, load=f"{root}/ranks", traces=traces)
    out["from_one_process"] = _run(rank, k2, 0.0, at, rc.STEPS, load=f"{root}/gpipe", traces=traces)
    # HuggingFace's GPT-2, its head tied across the ranks: from the plain model and back
    gpt2 = rc.plan(2, case="gpt2", traces=traces)
    out["gpt2"] = _run(rank, gpt2, 0.0, at, rc.STEPS, load=f"{root}/gpt2", save=f"{root}/gpt2",
                       case="gpt2", traces=traces)
    return {**out, "gpt2_plan": gpt2}


def _gpipe(plan: dict[str, Any], start: int, stop: int, traces: rc.Traces, *, load: Path | None = None,
           save: Path | None = None) -> dict[str, Tensor]:
    """:func:`_run` in this process: a GPipe of the plan's stages on two CPU 'devices'."""
    model, graph = rc.traced(traces)
    pipe = autopipe.pipeline(model, rc.batch(0)[:1], devices=["cpu", "cpu"], loss_fn=rc.lm_loss,
                             plan=Plan.from_dict(plan), graph=graph)
    opt, scheduler = rc.optimizer(pipe.parameters())
    if load is not None:
        assert pipe.load_checkpoint(load, opt, scheduler) == {"at": start}
        assert pipe.steps == start

    def step(n: int) -> None:
        x, y = rc.batch(n)
        pipe(x, target=y).backward()

    rc.train_steps(step, opt, scheduler, start, stop)
    if save is not None:
        pipe.save_checkpoint(save, opt, scheduler, extra={"at": stop})
    return rc.named_state(pipe.state_dict(keep_vars=True), opt)


def _plain(case: str, start: int, stop: int, *, load: Path | None = None,
           save: Path | None = None) -> dict[str, Tensor]:
    """:func:`_run` for the plain model (dropout off) in this process."""
    m = rc.model(case=case)
    opt, scheduler = rc.optimizer(m.parameters())
    if load is not None:
        loaded = load_checkpoint(load, m, opt, scheduler)
        assert (loaded.step, loaded.extra) == (start, {"at": start})

    def step(n: int) -> None:
        x, y = rc.batch(n)
        rc.lm_loss(m(x), y).backward()

    rc.train_steps(step, opt, scheduler, start, stop)
    if save is not None:
        save_checkpoint(save, m, opt, scheduler, extra={"at": stop}, step=stop)
    return rc.named_state(m.state_dict(keep_vars=True), opt)


def assert_matches(parts: list[dict[str, Tensor]], expected: dict[str, Tensor], what: str) -> None:
    """Every rank's tensors close to the reference's, and together all of them."""
    seen: set[str] = set()
    for r, part in enumerate(parts):
        for key, value in part.items():
            _close(value, expected[key], f"{what}: rank {r} {key}")
        seen |= set(part)
    assert seen == set(expected), f"{what}: missing {sorted(set(expected) - seen)[:4]}"


def assert_equal(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"{what}: not bit for bit: {differ[:4]}"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:autopipe. the plan was made for devices")  # stages of one CPU
def test_resume_on_two_ranks(tmp_path: Path) -> None:
    """Same plan (K=2, dropout on): bit for bit. Another K (4 stages, interleaved), one process
    (GPipe) -> 2 ranks, 2 ranks -> GPipe and -> the plain model, and HuggingFace's GPT-2 from
    the plain model to 2 ranks: close to the plain model's 6 steps; these run with dropout off
    (p=0), as masks drawn under another plan differ. Both LMs' heads are tied to their
    embeddings across the ranks (the first stage holds one, the last the other)."""
    traces: rc.Traces = {}  # this process's: the plans' graph, the GPipes' models
    plans = {"k2": rc.plan(2, traces=traces), "k4": rc.plan(4, schedule="interleaved1f1b", traces=traces)}
    _gpipe(plans["k2"], 0, rc.SAVED_AT, traces, save=tmp_path / "gpipe")
    _plain("gpt2", 0, rc.SAVED_AT, save=tmp_path / "gpt2")
    ranks = _ok(spawn(_ranks, str(tmp_path), plans, timeout=120))
    assert ranks[0]["gpt2_plan"] == ranks[1]["gpt2_plan"]  # made by each rank: the same
    for name, tie in (("k2", ("tok", "head")), ("k4", ("tok", "head")), ("gpt2", ("transformer.wte", "lm_head"))):
        first, *_, last = Plan.from_dict(plans.get(name) or ranks[0]["gpt2_plan"]).stages
        assert tie[0] in first and tie[1] in last and tie[1] not in first, (name, first, last)
    expected = rc.reference()
    for r, values in enumerate(ranks):
        assert_equal(values["resumed"], values["straight"], f"rank {r} resumed under its plan")
        assert not torch.allclose(values["straight"]["model.tok.weight"],
                                  expected["model.tok.weight"]), "dropout did not draw"
    for case in ("other_k", "from_one_process"):
        assert_matches([v[case] for v in ranks], expected, case)
    assert checkpoint_info(tmp_path / "ranks")["world"] == 2
    assert_matches([_gpipe(plans["k2"], rc.SAVED_AT, rc.STEPS, traces, load=tmp_path / "ranks")], expected,
                   "2 ranks -> GPipe")
    assert_matches([_plain("tiny", rc.SAVED_AT, rc.STEPS, load=tmp_path / "ranks")], expected,
                   "2 ranks -> the plain model")
    assert_matches([v["gpt2"] for v in ranks], rc.reference("gpt2"), "GPT-2: the plain model -> 2 ranks")
    back = _plain("gpt2", rc.STEPS, rc.STEPS, load=tmp_path / "gpt2")  # its newest step: the ranks'
    for r, values in enumerate(ranks):
        assert_equal(values["gpt2"], {k: back[k] for k in values["gpt2"]}, f"GPT-2: rank {r} -> the plain model")
