"""Tensor-parallel plans the runtime cannot run are refused in one line, before any rank's
collective: pipeline() (one process), a degree the model's heads or features do not take, a
model with no TP structure, a TP group across hosts, a world that is not PP x TP x DP, and the
same on the command line (exit 2) before torchrun starts a rank. The runs themselves:
tests/assemble/test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from autopipe.app.cli import main
from autopipe.assemble.local import pipeline
from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.assemble.tensor_parallel import check_cuts, check_world, roles_of
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.building.stages import build
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import _ok, spawn
from tests.models import Chain
from tests.solvers.test_tensor_parallel_search import _blocks


def _one_line(err: pytest.ExceptionInfo[BuildError]) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def test_pipeline_refuses_a_tp_plan_in_one_line() -> None:
    plan = partition(_blocks(), stages=2, devices=4, tensor_parallel=2, chunks=2, progress=False)
    with pytest.raises(BuildError, match="tensor_parallel=2 ranks, which runs on ranks only: use "
                                         r"autopipe.distributed_pipeline") as err:
        pipeline(Chain(), torch.randn(4, 8), devices=["cpu", "cpu"], plan=plan)
    _one_line(err)


def _gpt_graph() -> Any:
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)  # 2 heads, 32 MLP features
    return trace(model, (torch.randint(0, 16, (2, 4)),))


def test_sequence_parallel_refuses_an_example_of_tokens_the_degree_does_not_divide() -> None:
    graph = trace(TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4), (torch.randint(0, 16, (2, 3)),))
    assert roles_of(graph, 2).tokens == frozenset()  # without sequence parallelism: taken
    with pytest.raises(BuildError, match=r"^sequence parallelism splits the 3 tokens over tensor_parallel=2 "
                                         r"ranks, which do not divide them: pad the sequence to a multiple of 2, "
                                         r"or plan with sequence_parallel=False$") as err:
        roles_of(graph, 2, sequence=True)
    _one_line(err)
    assert {"add", "ln_f", "blocks_0_proj", "tok"} <= roles_of(_gpt_graph(), 2, sequence=True).tokens


def test_a_degree_the_heads_do_not_take_is_refused() -> None:
    graph = _gpt_graph()
    assert roles_of(graph, 2).vocab  # 16 words split too
    with pytest.raises(BuildError, match=r"^tensor_parallel=4 does not divide the heads and kv heads of "
                                         r"group attention:blocks.0.proj \(their greatest common divisor is 2\); "
                                         r"use one of \[1, 2\]$") as err:
        roles_of(graph, 4)
    _one_line(err)


def test_layers_recomputed_alone_that_end_inside_a_group_are_refused() -> None:
    # a segment is rewritten on its own: one that ends between a group's column and its row
    # would hand on split values; whole groups run (tests/assemble/test_tensor_parallel.py)
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)
    graph = trace(model, (torch.randint(0, 16, (2, 4)),))
    plan = Plan.from_stages(cost_profile(graph), [graph.layers], chunks=1, recompute="never",
                            recompute_layers=["blocks.0.ln2", "blocks.0.fc1"])
    with pytest.raises(BuildError, match=r"^stage 0's layers recomputed alone in recomputed_0 begin or end inside "
                                         r"group 'mlp:blocks.0.fc2' .*tensor_parallel=1$") as err:
        check_cuts(build(model, plan, graph), roles_of(graph, 2))
    _one_line(err)


def test_a_model_without_tp_structure_is_refused() -> None:
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3))
    graph = trace(cnn, (torch.randn(2, 3, 8, 8),))
    with pytest.raises(BuildError, match=r"^tensor_parallel=2: the model has no tensor-parallel structure "
                                         r".*use tensor_parallel=1$") as err:
        roles_of(graph, 2)
    _one_line(err)


def test_a_tp_group_across_hosts_or_a_world_it_does_not_split_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_world(2, 8)  # two hosts of 4: groups of 2 stay inside one
    with pytest.raises(BuildError, match=r"^the plan splits each stage over tensor_parallel=2 ranks but the "
                                         r"world has 7; start PP x TP x DP ranks") as err:
        check_world(2, 7)
    _one_line(err)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(BuildError, match=r"^tensor_parallel=2 would span hosts of 3 ranks \(LOCAL_WORLD_SIZE\)"
                                         r".* a degree that divides 3") as err:
        check_world(2, 6)
    _one_line(err)


def _world_of_two(rank: int, plan: dict[str, Any]) -> str:
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)
    x = torch.randint(0, 16, (4, 4))
    try:
        distributed_pipeline(model, (x,), loss_fn=lambda out, y: out.sum(), chunks=2, plan=Plan.from_dict(plan))
    except BuildError as err:
        return str(err)
    return ""


def test_a_world_not_pp_x_tp_x_dp_is_refused_on_every_rank() -> None:
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)
    graph = trace(model, microbatch_inputs((torch.randint(0, 16, (4, 4)),), 2))
    plan = dataclasses.replace(partition(cost_profile(graph), stages=2, method="uniform", chunks=2),
                               tensor_parallel=2)
    for message in _ok(spawn(_world_of_two, plan.to_dict())):  # 2 stages x TP 2 on 2 ranks
        assert message.startswith("the plan has 2 stages but 1 ranks of tensor_parallel=2 need the same "
                                  "number of stages each (1 in all); start 4 ranks (torchrun "
                                  "--nproc_per_node 4, PP x TP x DP)"), message


def test_run_refuses_a_tp_plan_it_cannot_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = partition(_blocks(), stages=2, devices=4, tensor_parallel=2, chunks=2, progress=False)
    path = plan.save(tmp_path / "tp.json")
    assert main(["run", "mlp", "--plan", str(path), "--nproc", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--nproc 3 does not split into the plan's tensor_parallel=2 groups; start PP x TP x DP" in err


def test_replicas_of_a_tp_pipeline_run_under_fsdp_only() -> None:
    from autopipe.assemble.tensor_parallel import check_replicas

    check_replicas(2, 2, "fsdp")
    check_replicas(2, 1, "ddp")  # one replica: nothing to share
    with pytest.raises(BuildError, match=r"^tensor_parallel=2 with data_parallel=2 runs under dp_mode='fsdp' "
                                         r"only .*use dp_mode='fsdp'") as err:
        check_replicas(2, 2, "ddp")
    _one_line(err)


def _refused_on_rank_one(rank: int, plan: dict[str, Any]) -> str:
    import autopipe.assemble.tensor_parallel as tp

    original = tp.shard_stage

    def refuse(*args: Any, **kwargs: Any) -> None:  # what a rewrite of this rank's stage alone meets
        if rank == 1:
            raise BuildError("tensor parallelism cannot split linear_9 (injected)")
        original(*args, **kwargs)

    tp.shard_stage = refuse  # type: ignore[assignment]
    try:
        return _world_of_two(rank, plan)
    finally:
        tp.shard_stage = original


def test_a_stage_one_rank_cannot_rewrite_is_refused_on_every_rank() -> None:
    # each rank rewrites its own stages: the others would build and wait for it in their first step
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)
    graph = trace(model, microbatch_inputs((torch.randint(0, 16, (4, 4)),), 2))
    plan = dataclasses.replace(partition(cost_profile(graph), stages=1, method="uniform", chunks=2),
                               tensor_parallel=2)
    assert _ok(spawn(_refused_on_rank_one, plan.to_dict())) == [
        "rank 1: tensor parallelism cannot split linear_9 (injected)",
        "tensor parallelism cannot split linear_9 (injected)"]
