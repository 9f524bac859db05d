"""partition(data_parallel=D | "auto"): replicas x stages chosen by simulated time per global
batch ([Note: pipeline x data parallel]); autopipe/solvers/data_parallel_search.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.errors import PartitionError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import chain_profile, random_chain

MiB = 1 << 20
AUTO = dict(chunks="auto", recompute="auto", schedule="auto", progress=False)


def _chain(param_bytes: int, fwd_ms: float = 1.0) -> Profile:
    """8 equal layers, profiled at 4 rows of a batch of 32 in 8 micro-batches."""
    prof = chain_profile([fwd_ms] * 8, param_bytes=[param_bytes] * 8, output_bytes=1 << 16,
                         saved_bytes=1 << 18)
    prof.meta.update(micro_batch_size=4, batch_size=32, chunks=8)
    return prof


def _fits(plan: Plan) -> bool:
    limit = plan.devices[0].memory
    return limit is None or max([*plan.device_memory.values(), *plan.stage_memory]) <= limit


def test_a_small_model_runs_one_copy_per_device() -> None:
    plan = partition(_chain(64 << 10), devices=4, data_parallel="auto", progress=False)
    assert (plan.data_parallel, plan.num_stages) == (4, 1)
    assert plan.batch_size == 32 and plan.micro_batch_size == 1  # 8 rows a replica, M = 8
    others = {a.data_parallel: a.iteration_time for a in plan.alternatives if a.note.startswith("best")}
    assert set(others) == {1, 2} and all(t > plan.iteration_time for t in others.values())
    assert "| replicas | stages |" in plan.explain() and "4 replicas (ddp) x 1 stage(s)" in plan.explain()


def test_a_model_that_fits_only_when_split_runs_one_pipeline() -> None:
    # 8 x 64 MiB of parameters, 256 MiB a layer with adam and 128 MiB while Adam steps one on the
    # CPU ([Note: the optimizer step's memory]): 700 MiB holds 2 layers, so 4 stages
    plan = partition(_chain(64 * MiB, 20.0), devices=4, data_parallel="auto", memory_limit=700 * MiB,
                     progress=False)
    assert (plan.data_parallel, plan.num_stages) == (1, 4) and _fits(plan)
    assert "2, 4 do(es) not fit" in plan.solver.status


def test_between_when_two_stages_fit_and_replicas_are_faster() -> None:
    # 1200 MiB holds 4 layers (and a step): 2 replicas of 2 stages beat 1 pipeline of 4 (fewer bubbles)
    prof = _chain(64 * MiB, 20.0)
    plan = partition(prof, devices=4, data_parallel="auto", memory_limit=1200 * MiB, progress=False)
    assert (plan.data_parallel, plan.num_stages) == (2, 2) and _fits(plan)
    one = partition(prof, devices=4, data_parallel=1, batch_size=32, memory_limit=1200 * MiB,
                    progress=False)
    assert plan.iteration_time < one.iteration_time
    assert plan.breakdown[0].grad_sync_ms == pytest.approx(2 * 0.5 * 4 * 64 * MiB * 1e-7)  # 10 GB/s
    assert simulate(plan, prof).iteration_time == pytest.approx(plan.iteration_time)


def test_auto_is_never_slower_than_any_replica_count_it_searched() -> None:
    prof = random_chain(12, 7)
    prof.meta.update(micro_batch_size=2, batch_size=12, chunks=6)
    common = dict(devices=6, memory_limit="96MiB", bandwidth=2e9, batch_size=12, **AUTO)
    auto = partition(prof, data_parallel="auto", **common)  # type: ignore[arg-type]
    assert _fits(auto)
    compared = 0
    for d in (1, 2, 3, 6):
        try:
            fixed = partition(prof, data_parallel=d, **common)  # type: ignore[arg-type]
        except PartitionError:
            continue  # does not fit
        compared += 1
        assert fixed.data_parallel == d and fixed.batch_size == 12
        assert auto.iteration_time <= fixed.iteration_time * (1 + 1e-12), d
    assert compared >= 3


def test_fsdp_fits_where_ddp_does_not() -> None:
    # 512 MiB of parameters: DDP keeps 4 x 512 MiB per copy, FSDP over 8 (2 + 4 / 8) x 512 MiB
    prof = _chain(64 * MiB)
    with pytest.raises(PartitionError, match="data_parallel=8: .*fewer replicas"):
        partition(prof, devices=8, data_parallel=8, chunks=4, memory_limit="1400MiB", progress=False)
    plan = partition(prof, devices=8, data_parallel=8, dp_mode="fsdp", chunks=4,
                     memory_limit="1400MiB", progress=False)
    assert plan.num_stages == 1 and plan.stage_memory[0] <= 1400 * MiB and plan.dp_mode == "fsdp"
    assert plan.breakdown[0].param_gather_ms > 0
    ddp = partition(prof, devices=8, data_parallel="auto", chunks=4, memory_limit="1400MiB",
                    progress=False)
    assert ddp.data_parallel < 8


def test_one_replica_is_the_plan_it_always_was() -> None:
    prof = random_chain(10, 4)
    one, plain = partition(prof, stages=3, chunks=4, data_parallel=1), partition(prof, stages=3, chunks=4)
    assert replace(one, solver=plain.solver) == plain


def test_stages_per_replica_from_stages_and_devices() -> None:
    prof = _chain(1 << 16)
    plan = partition(prof, stages=2, data_parallel=4, progress=False)  # no devices: 4 x 2
    assert (plan.data_parallel, plan.num_stages) == (4, 2)
    searched = partition(prof, devices=8, data_parallel=2, stages="auto", progress=False)
    assert searched.data_parallel == 2 and searched.num_stages <= 4


@pytest.mark.parametrize(("kw", "match"), [
    (dict(devices=4, data_parallel=3), r"data_parallel=3 does not divide the 4 devices .* use one of \[1, 2, 4\]"),
    (dict(devices=4, data_parallel=8), "data_parallel=8 > 4 devices: each replica needs at least one"),
    (dict(devices=4, data_parallel=4, batch_size=18), "batch_size=18 does not split evenly over data_parallel=4"),
    (dict(devices=4, data_parallel=4, chunks=16), "leaves 8 rows of batch_size=32 per replica, fewer than chunks=16"),
    (dict(devices=4, data_parallel=2, dp_mode="zero"), r"dp_mode='zero': choose one of \['ddp', 'fsdp'\]"),
    (dict(devices=4, data_parallel=0), "data_parallel=0: need an integer number of replicas"),
    (dict(devices=4, data_parallel="two"), "data_parallel='two': need an integer"),
    (dict(stages=2, data_parallel="auto"), "data_parallel='auto' shares devices among replicas: pass devices=N"),
    (dict(devices=4, stages=2, data_parallel="auto"), r"data_parallel='auto' sets each replica's stages"),
    (dict(devices=4, stages=4, data_parallel=2), "stages=4 with data_parallel=2 needs 8 devices, got 4"),
])
def test_bad_replicas_are_one_line(kw: dict[str, object], match: str) -> None:
    with pytest.raises(PartitionError, match=match) as err:
        partition(_chain(1 << 16), progress=False, **kw)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_auto_needs_a_batch_it_can_split() -> None:
    prof = random_chain(6, 1)  # no micro-batch rows recorded
    with pytest.raises(PartitionError, match="data_parallel='auto' compares replica counts at one global batch"):
        partition(prof, devices=4, data_parallel="auto")
    with pytest.raises(PartitionError, match="does not record its micro-batch rows"):
        partition(prof, devices=4, data_parallel=2, batch_size=8)
    plan = partition(prof, devices=4, data_parallel=2, chunks=2)  # the profile's micro-batch each
    assert plan.data_parallel == 2 and plan.batch_size is None
