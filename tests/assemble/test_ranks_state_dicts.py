"""distributed_pipeline(..., plan=plan) with one recompute mode per stage, on 2 gloo ranks.

Each stage recomputes exactly executor.spec.recomputed_microbatches(its mode) micro-batches
(counted as calls of the stage module: ``chunks`` forwards plus one per recomputation), none
in eval mode, and the loss and every gradient equal one process's ([Note: loss of a pipeline]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.errors import BuildError
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from executor.ranks.distributed import DistributedError, DistributedPipeline
from executor.spec import recomputed_microbatches
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import (
    CHUNKS,
    _assert_matches_reference,
    _case,
    _ok,
    one_rank,  # noqa: F401 - the fixture, used by name
    spawn,
)


def _counted(stage: nn.Module, calls: dict[int, int], i: int) -> None:
    def count(_module: nn.Module, _args: Any) -> None:
        calls[i] += 1

    stage.register_forward_pre_hook(count)


def _per_stage(rank: int, case: str, schedule: str, modes: list[str]) -> dict[str, Any]:
    model, inputs, target, loss_fn = _case(case)
    graph = trace(model, microbatch_inputs(inputs, CHUNKS))
    plan = partition(cost_profile(graph), stages=len(modes), method="uniform", chunks=CHUNKS)
    plan = dataclasses.replace(plan, recompute=list(modes))  # the same plan on every rank
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule,
                                plan=plan, timeout=20)
    calls = dict.fromkeys(pipe.indices, 0)
    for i, stage in zip(pipe.indices, pipe.stages, strict=True):
        _counted(stage, calls, i)
    loss = pipe.step(*inputs, target=target)
    grads = {n: p.grad.clone() for s in pipe.stages for n, p in s.named_parameters()
             if p.grad is not None}
    trained = dict(calls)
    for stage in pipe.stages:  # eval mode: forward and backward, nothing recomputed
        stage.eval()
    calls.update(dict.fromkeys(calls, 0))
    pipe.step(*inputs, target=target)
    return {"loss": loss, "grads": grads, "calls": trained, "eval_calls": dict(calls),
            "checkpoints": pipe.recompute_modes}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("case", "schedule", "modes"),
    [
        ("skip", "gpipe", ["always", "except_last"]),
        ("gpt2", "1f1b", ["never", "always"]),  # the tied embedding and head on two ranks
        ("mlp", "interleaved1f1b", ["always", "never", "except_last", "always"]),
    ],
)
def test_per_stage_modes_on_two_ranks(case: str, schedule: str, modes: list[str]) -> None:
    values = _ok(spawn(_per_stage, case, schedule, modes, timeout=80))
    if schedule == "interleaved1f1b":
        values[0]["loss"] = None  # stage 3, the last, is on rank 1
    _assert_matches_reference(case, values)
    for v in values:
        assert v["checkpoints"] == modes
        assert v["calls"] == {i: CHUNKS + recomputed_microbatches(modes[i], CHUNKS)
                              for i in v["calls"]}, v["calls"]
        assert v["eval_calls"] == dict.fromkeys(v["calls"], CHUNKS)
    assert sorted(i for v in values for i in v["calls"]) == list(range(len(modes)))


@pytest.mark.usefixtures("one_rank")
def test_bad_per_stage_modes_end_in_one_line() -> None:
    with pytest.raises(DistributedError, match=r"^recompute lists 1 mode\(s\) for 2 stage\(s\); "
                                               r"give one mode per stage") as err:
        DistributedPipeline([nn.Identity()], [0], 2, loss_fn=torch.sub, recompute=["never"],
                            wires=[(), (), ()])
    assert "\n" not in str(err.value)
    with pytest.raises(DistributedError, match=r"^recompute\[1\]='all' is not a recompute mode"):
        DistributedPipeline([nn.Identity()], [0], 2, loss_fn=torch.sub,
                            recompute=["never", "all"], wires=[(), (), ()])
    model, inputs, _, loss_fn = _case("mlp")
    with pytest.raises(BuildError, match=r"^recompute=\['never', 'always'\] gives one mode per "
                                         r"stage, which only a plan made for them predicts"):
        distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS,
                             recompute=["never", "always"], stages_per_rank=2)
