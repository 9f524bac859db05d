from __future__ import annotations

import pytest

import autopipe
from autopipe.core.cost import DeviceSpec
from autopipe.errors import PartitionError
from autopipe.solvers.partitioner import is_chain, partition
from autopipe.solvers.synthetic import chain_profile, random_chain, transformer_dag


def test_public_name_is_the_function() -> None:
    prof = random_chain(10)
    assert autopipe.partition is partition
    assert autopipe.partition(prof, stages=2).bottleneck == partition(prof, stages=2).bottleneck


def test_auto_on_a_chain_reports_optimal() -> None:
    prof = random_chain(30, 4)
    assert is_chain(prof)
    plan = partition(prof, stages=4, chunks=4)  # the fastest step, every one of its 3,654 splits bounded
    assert plan.method in ("exact", "step") and plan.solver.status == "optimal" and plan.solver.gap == 0.0
    assert plan.lower_bound <= plan.bottleneck
    exact = partition(prof, stages=4, chunks=4, method="exact")
    assert exact.method == "exact" and exact.solver.status == "optimal"
    for base in ("uniform", "params", "blockpartition"):
        other = partition(prof, stages=4, method=base, chunks=4)
        assert other.bottleneck >= exact.bottleneck - 1e-9 and other.iteration_time >= plan.iteration_time - 1e-9


def test_auto_on_a_dag_with_one_order_is_exact_and_the_ilp_agrees() -> None:
    prof = transformer_dag(2)  # residual skips beside a path through every layer
    assert not is_chain(prof)
    plan = partition(prof, stages=3, time_limit=20)
    assert plan.solver.gap == 0.0 and plan.solver.status == "optimal"
    exact = partition(prof, stages=3, method="exact")
    assert exact.solver.gap == 0.0 and exact.solver.status == "optimal"
    ilp = partition(prof, stages=3, method="ilp", time_limit=20)
    assert ilp.method == "ilp" and ilp.bottleneck == pytest.approx(exact.bottleneck)


def test_heterogeneous_speeds_shift_layers_to_faster_device() -> None:
    prof = chain_profile([1.0] * 12)
    plan = partition(prof, devices=[DeviceSpec("slow"), DeviceSpec("fast", speed=2.0), "cuda:2"])
    sizes = [len(s) for s in plan.stages]
    assert sizes[1] > sizes[0] and sizes[1] > sizes[2]
    assert [d.name for d in plan.devices] == ["slow", "fast", "cuda:2"]


def test_memory_limit_binds_and_is_reported() -> None:
    prof = chain_profile([1.0] * 8, param_bytes=[1 << 20] * 8)
    free = partition(prof, stages=2, optimizer="none", recompute="never")
    assert [len(s) for s in free.stages] == [4, 4]
    first_small = partition(prof, devices=[DeviceSpec("a", 3 << 20), DeviceSpec("b")],
                            optimizer="none", recompute="never")
    assert [len(s) for s in first_small.stages] == [3, 5]
    with pytest.raises(PartitionError, match=r"needs at least 4.0 MiB.*limit is 2.0 MiB; 4 stages are the fewest that fit \(--stages 4 / stages=4\)$"):
        partition(prof, stages=2, memory_limit="2MiB", optimizer="none", recompute="never")


@pytest.mark.parametrize("ties", ["share", "colocate"])
def test_ties(ties: str) -> None:
    # l1 and l3 share 4 MiB; with 'share' both stages pay it, with 'colocate' one stage holds both
    prof = chain_profile([1.0] * 6, param_bytes=[0, 4 << 20, 0, 4 << 20, 0, 0],
                         tie_group=["", "w", "", "w", "", ""])
    plan = partition(prof, stages=2, ties=ties, optimizer="none", recompute="never")
    holders = [s for s, names in enumerate(plan.stages) if {"l1", "l3"} & set(names)]
    if ties == "colocate":
        assert len(holders) == 1 and sorted(plan.stage_memory)[0] == 0
    else:
        assert plan.stages == [["l0", "l1", "l2"], ["l3", "l4", "l5"]]
        assert plan.stage_memory == [4 << 20, 4 << 20]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 11}, r"stages=11 > 10 layers: a stage would be empty; use stages <= 10"),
        ({"stages": 0}, r"stages=0: need an integer K >= 1"),
        ({}, "give stages=K or devices"),
        ({"stages": 2, "method": "magic"}, "method='magic' is unknown"),
        ({"stages": 2, "chunks": 0}, "chunks=0"),
        ({"stages": 2, "recompute": "maybe"}, "recompute='maybe'"),
        ({"stages": 2, "memory_limit": "lots"}, "cannot read memory size 'lots'"),
        ({"stages": 2, "ties": "glue"}, "ties='glue'"),
        ({"devices": []}, r"devices=\[\] is empty"),
    ],
)
def test_bad_input(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PartitionError, match=match):
        partition(random_chain(10), **kwargs)


def test_rejects_non_profile() -> None:
    with pytest.raises(PartitionError, match="needs an autopipe.Profile"):
        partition([1, 2, 3], stages=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("partition_quality", ["--random-n", "8", "--seeds", "1", "--gpt-blocks", "8", "--dag-blocks", "1",
                               "--time-limit", "10"]),
        ("partition_speed", ["--dp-n", "20", "--dp-k", "2", "--ilp-blocks", "1", "--ilp-k", "2",
                             "--time-limit", "10"]),
    ],
)
def test_benchmarks_run_tiny(name: str, argv: list[str]) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.main(argv)
    assert table.startswith("| ") and table.count("\n") >= 2


def test_chunks_default_to_the_profiled_micro_batch() -> None:
    prof = chain_profile([1.0, 2.0, 3.0, 4.0])
    assert partition(prof, stages=2).chunks == 8  # nothing recorded: the documented default
    prof.meta["chunks"] = 4  # measured as 1 of 4 micro-batches: the plan fits that pipeline
    assert partition(prof, stages=2).chunks == 4
    assert partition(prof, stages=2, chunks=2).chunks == 2


def test_stages_are_named_after_the_profiled_device_kind() -> None:
    prof = random_chain(6, 1)
    assert [d.name for d in partition(prof, stages=2).devices] == ["stage0", "stage1"]  # kind unknown
    prof.meta["device_type"] = "cpu"
    plan = partition(prof, stages=3, memory_limit="1GiB")
    assert [(d.name, d.memory) for d in plan.devices] == [(f"cpu:{s}", 1 << 30) for s in range(3)]
    assert plan.table().splitlines()[1].split()[:2] == ["0", "cpu:0"]
    assert [d.name for d in partition(prof, devices=["cpu", "cpu"]).devices] == ["cpu", "cpu"]
    with pytest.raises(PartitionError, match="stages=0: need an integer K >= 1"):
        partition(prof, stages=0)


def test_checkpoint_is_recomputes_old_name_for_one_release() -> None:
    """[Note: recompute, not checkpoint]: the old keyword still plans the same, with one warning."""
    prof = random_chain(10, 3)
    with pytest.warns(DeprecationWarning, match=r"^partition\(checkpoint='always'\) is now "
                                                 r"partition\(recompute='always'\); checkpoint= will be "
                                                 r"removed in the next release$"):
        old = partition(prof, stages=3, checkpoint="always")
    new = partition(prof, stages=3, recompute="always")
    assert old.recompute == new.recompute == "always"
    assert (old.stages, old.stage_times, old.iteration_time) == (new.stages, new.stage_times,
                                                                 new.iteration_time)


@pytest.mark.parametrize("replicas", [1, 2])
def test_interleaved_stages_on_ranks_named_once_are_placed_as_the_runtime_places_them(replicas: int) -> None:
    # stages=2W on W ranks a replica (devices=N or W names): each rank's device to stages s and
    # s + W, as executor.spec.stage_rank places them; it was refused ("stages=8 but 4 devices")
    prof = transformer_dag(4, hidden_bytes=1 << 20)
    plan = partition(prof, devices=4 * replicas, stages=8, chunks=8, schedule="interleaved1f1b",
                     data_parallel=replicas)
    names = [d.name for d in plan.devices]
    assert len(plan.stages) == 8 and names == names[:4] * 2 and len(set(names)) == 4
    named = partition(prof, devices=["a", "b"], stages=6, chunks=4, schedule="interleaved1f1b")
    assert [d.name for d in named.devices] == ["a", "b"] * 3
    with pytest.raises(PartitionError, match=r"^stages=3 but 2 devices given"):
        partition(prof, devices=["a", "b"], stages=3, chunks=4, schedule="interleaved1f1b")
