"""[Note: pipeline x data parallel]: the collectives' formulas, the sharded state, and the
simulator running a stage's gradient sync after its last backward, against hand-computed
numbers."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from autopipe.core.cost import DeviceSpec, StageCost, state_bytes
from autopipe.core.cost_options import CostOptions
from autopipe.core.data_parallel import (
    allreduce_ms,
    grad_sync_ms,
    param_gather_ms,
    replica_devices,
    ring_ms,
    state_factor,
)
from autopipe.core.plan import Alternative, Plan
from autopipe.core.simulator import simulate, simulate_stages
from autopipe.errors import PartitionError, PlanError
from autopipe.solvers.synthetic import chain_profile, random_chain
from executor.spec import DATA_PARALLEL_PHASES, PHASES

MB = 10**6
MS_PER_BYTE = 1e-6  # 1 GB/s


def test_ring_collectives_by_hand() -> None:
    # 4 replicas, 1000 bytes at 1 byte/us: each rank sends 3/4 of them per ring pass
    assert ring_ms(1000, 4, 1e-3) == pytest.approx(0.75)
    assert allreduce_ms(1000, 4, 1e-3) == pytest.approx(1.5)  # 2 (D-1)/D x bytes
    assert grad_sync_ms(1000, 4, "ddp", 1e-3) == pytest.approx(1.5)
    assert grad_sync_ms(1000, 4, "fsdp", 1e-3) == pytest.approx(0.75)  # a reduce-scatter
    assert param_gather_ms(1000, 4, "fsdp", 1e-3) == pytest.approx(0.75)
    assert param_gather_ms(1000, 4, "ddp", 1e-3) == 0.0
    assert grad_sync_ms(1000, 1, "ddp", 1e-3) == 0.0  # one replica: nothing to sync


def test_sharded_state_by_hand() -> None:
    # adam (factor 4) over 4 replicas: unsharded weights + unsharded grads + 4 P / 4 sharded
    assert state_factor(4, 4, "fsdp") == 3
    assert state_factor(4, 8, "fsdp") == 2.5
    assert state_factor(4, 2, "fsdp") == 4  # no saving at D = 2: the unsharded copies cost it
    assert state_factor(1, 2, "fsdp") == 1.5  # weights only: no gradients to accumulate
    assert state_factor(4, 8, "ddp") == 4 and state_factor(4, 1, "fsdp") == 4
    assert state_bytes(1000, 10, "adam", 4, "fsdp") == 3010
    assert state_bytes(1000, 10, "adam") == 4010


def test_replica_devices_take_the_least_of_each_stage() -> None:
    pool = [DeviceSpec("a", 8, 1.0), DeviceSpec("b", 8, 2.0), DeviceSpec("c", 4, 1.0),
            DeviceSpec("d", None, 0.5)]
    assert replica_devices(pool, 2) == [DeviceSpec("a", 4, 1.0), DeviceSpec("b", 8, 0.5)]
    assert replica_devices(pool, 1) == pool
    with pytest.raises(PartitionError, match="does not divide the 4 devices"):
        replica_devices(pool, 3)


def test_options_check_the_replicas() -> None:
    with pytest.raises(PartitionError, match=r"dp_mode='zero': choose one of \['ddp', 'fsdp'\]"):
        CostOptions(data_parallel=2, dp_mode="zero")
    with pytest.raises(PartitionError, match="data_parallel=0: need an integer"):
        CostOptions(data_parallel=0)


def _two_stages(data_parallel: int, dp_mode: str = "ddp") -> Plan:
    # layers of 1 ms forward, 2 ms backward, nothing crosses the cut; stage 0 holds 1 MB of
    # parameters, stage 1 5 MB
    prof = chain_profile([1.0, 1.0], param_bytes=[MB, 5 * MB])
    return Plan.from_stages(prof, [["l0"], ["l1"]], chunks=2, recompute="never",
                            bandwidth=1e9, data_parallel=data_parallel, dp_mode=dp_mode)


def test_ddp_allreduce_overlaps_the_earlier_stages_backward() -> None:
    # GPipe, 2 stages x 2 micro-batches: stage 1's backwards end at 7 ms, stage 0's at 9 ms.
    # All-reduce over 2 replicas: 2 x 1/2 x bytes x 1e-6 ms = 1 ms (stage 0), 5 ms (stage 1).
    # Stage 1's runs 7 .. 12 while stage 0 still computes: max(7 + 5, 9 + 1) = 12, not 9 + 5 + 1.
    plan = _two_stages(2)
    assert [b.grad_sync_ms for b in plan.breakdown] == pytest.approx([1.0, 5.0])
    assert plan.iteration_time == pytest.approx(12.0)
    assert _two_stages(1).iteration_time == pytest.approx(9.0)
    sim = simulate(plan)
    sync = [(e.stage, e.microbatch, e.start_ms, e.end_ms) for e in sim.timeline if e.phase == "allreduce"]
    assert sync == [(1, 1, pytest.approx(7.0), pytest.approx(12.0)),
                    (0, 1, pytest.approx(9.0), pytest.approx(10.0))]
    assert sim.bubble_fraction == pytest.approx(1 - 12 / (2 * 12))  # collectives are not busy
    assert "allreduce 7.000 .. 12.000 ms" in sim.summary()


def test_fsdp_gathers_before_the_first_forward_and_reduce_scatters_after_the_last_backward() -> None:
    # gathers of 0.5 ms (stage 0) and 2.5 ms (stage 1, once micro-batch 0 arrives at 1.5 ms):
    # stage 0 forwards 0.5 .. 2.5; stage 1 gathers 1.5 .. 4, forwards 4 .. 6, backwards 6 .. 10;
    # stage 0 backwards 8 .. 12; reduce-scatters 10 .. 12.5 and 12 .. 12.5
    plan = _two_stages(2, "fsdp")
    events = {(e.stage, e.phase): (e.start_ms, e.end_ms) for e in simulate(plan).timeline
              if e.phase in DATA_PARALLEL_PHASES}
    assert events == {(0, "allgather"): pytest.approx((0.0, 0.5)),
                      (1, "allgather"): pytest.approx((1.5, 4.0)),
                      (1, "reducescatter"): pytest.approx((10.0, 12.5)),
                      (0, "reducescatter"): pytest.approx((12.0, 12.5))}
    assert plan.iteration_time == pytest.approx(12.5)
    assert set(DATA_PARALLEL_PHASES) <= set(PHASES)


def test_fsdp_shards_the_stage_state() -> None:
    prof = chain_profile([1.0, 1.0], param_bytes=[4 * MB, 4 * MB])
    plans = {(d, mode): Plan.from_stages(prof, [["l0", "l1"]], chunks=1, recompute="never",
                                         data_parallel=d, dp_mode=mode)
             for d in (1, 4) for mode in ("ddp", "fsdp")}
    # 8 MB x adam's 4, and while Adam steps a layer's 4 MB on the CPU, two copies of it (the
    # peak: [Note: the optimizer step's memory] in stage_memory.py)
    assert plans[1, "ddp"].stage_memory == [32 * MB + 8 * MB]
    assert plans[4, "ddp"].stage_memory == [32 * MB + 8 * MB]  # replicas copy it all
    assert plans[4, "fsdp"].stage_memory == [24 * MB + 2 * MB]  # 8 + 8 unsharded + 4 x 8 / 4; a shard's step
    assert plans[1, "fsdp"] == replace(plans[1, "ddp"], dp_mode="fsdp")  # one replica: nothing shards


def test_one_replica_costs_as_before() -> None:
    prof = random_chain(10, 2)
    base = Plan.from_stages(prof, [prof.layers[:4], prof.layers[4:]], chunks=4)
    assert all(b.grad_sync_ms == 0 and b.param_gather_ms == 0 for b in base.breakdown)
    assert not any(e.phase in DATA_PARALLEL_PHASES for e in simulate(base).timeline)
    assert base.data_parallel == 1 and base.cost_options == CostOptions(4, "except_last")


def test_the_global_batch_is_the_replicas_together() -> None:
    prof = random_chain(6, 1)
    prof.meta.update(micro_batch_size=2, batch_size=8, chunks=4)  # one replica's batch
    plan = Plan.from_stages(prof, [prof.layers[:3], prof.layers[3:]], chunks=4, data_parallel=3)
    assert plan.batch_size == 24 and plan.micro_batch_size == 2
    assert "Each replica trains 8 of the 24 rows" in plan.explain()


def test_plan_json_round_trips_with_replicas(tmp_path: Path) -> None:
    prof = random_chain(8, 3)
    alt = Alternative(4, 8, "gpipe", "never", 12.0, 1.5, 10, "best with 1 replica(s)", 1)
    plan = Plan.from_stages(prof, [prof.layers[:4], prof.layers[4:]], chunks=4, data_parallel=2,
                            dp_mode="fsdp", alternatives=[alt])
    again = Plan.load(plan.save(tmp_path / "p.json"))
    assert again == plan and again.data_parallel == 2 and again.dp_mode == "fsdp"
    assert again.breakdown[0].param_gather_ms > 0
    assert simulate(again, prof).iteration_time == pytest.approx(plan.iteration_time)
    assert "| replicas | stages |" in again.explain() and "2 replicas (fsdp) x 2 stage(s)" in again.explain()
    # a plan written before replicas: no data_parallel, dp_mode, collectives or alternative's D
    old = json.loads((tmp_path / "p.json").read_text())
    for key in ("data_parallel", "dp_mode"):
        del old[key]
    for stage in old["breakdown"]:
        del stage["grad_sync_ms"], stage["param_gather_ms"]
    del old["alternatives"][0]["data_parallel"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Plan.load(tmp_path / "old.json")
    assert loaded.data_parallel == 1 and loaded.dp_mode == "ddp"
    assert loaded.alternatives[0].data_parallel == 1
    assert loaded.breakdown[0] == StageCost(**{**asdict(plan.breakdown[0]), "grad_sync_ms": 0.0,
                                               "param_gather_ms": 0.0})
    old["dp_mode"] = "zero"
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(PlanError, match=r"malformed field: 'dp_mode' must be one of \['ddp', 'fsdp'\], got 'zero'; "):
        Plan.load(tmp_path / "bad.json")


def test_shared_devices_run_their_collectives_in_turn() -> None:
    # interleaved: 4 stages on 2 ranks; each rank's two all-reduces never overlap each other
    prof = chain_profile([1.0] * 4, param_bytes=[MB] * 4)
    plan = Plan.from_stages(prof, [[n] for n in prof.layers], devices=["r0", "r1", "r0", "r1"],
                            chunks=4, schedule="interleaved1f1b", bandwidth=1e9, data_parallel=2)
    sim = simulate_stages(plan.breakdown, chunks=4, recompute=plan.recompute, ms_per_byte=MS_PER_BYTE,
                          schedule="interleaved1f1b", devices=["r0", "r1", "r0", "r1"])
    for rank in (0, 1):
        spans = sorted((e.start_ms, e.end_ms) for e in sim.timeline
                       if e.phase == "allreduce" and e.stage % 2 == rank)
        assert len(spans) == 2 and spans[0][1] <= spans[1][0] + 1e-9
    assert sim.iteration_time == pytest.approx(plan.iteration_time)
