"""partition(tensor_parallel=t | "auto") on devices = PP x TP x DP ([Note: the mesh] in
autopipe/solvers/tensor_parallel_search.py), against hand-computed iterations and a brute force
over the degrees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.app.cli import main
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate
from autopipe.errors import PartitionError
from autopipe.solvers.partitioner import partition
from autopipe.solvers.synthetic import chain_profile

BLOCK = [("ln", "replicated", 1.0, 0), ("col", "column", 4.0, 4096), ("act", "sharded", 2.0, 0),
         ("row", "row", 4.0, 4096), ("add", "replicated", 1.0, 0)]
OUT = 1000  # every layer's output, bytes
ONE = dict(chunks=1, recompute="never", progress=False)


def _blocks(n: int = 4, divides: int = 8) -> Profile:
    """n blocks of ln, a column / sharded / row group, add; micro-batch of 4 rows in 8."""
    layers = [(f"b{b}.{name}", role, ms, params) for b in range(n) for name, role, ms, params in BLOCK]
    prof = chain_profile([ms for *_, ms, _ in layers], param_bytes=[p for *_, p in layers],
                         output_bytes=OUT, saved_bytes=OUT)
    prof.df["tp_role"] = [role for _, role, _, _ in layers]
    prof.df["tp_group"] = [f"mlp:b{name.split('.')[0][1:]}.row" if role != "replicated" else ""
                           for name, role, _, _ in layers]
    prof.df["tp_divides"] = [divides if role != "replicated" else 0 for _, role, _, _ in layers]
    prof.meta.update(micro_batch_size=4, batch_size=32, chunks=8)
    return prof


def _tokens(n: int = 4) -> Profile:
    """The blocks with ln and add on the tokens' path ([Note: sequence parallelism])."""
    prof = _blocks(n)
    prof.df["tp_role"] = prof.df["tp_role"].replace("replicated", "sequence")
    return prof


def _work(prof: Profile, degree: int) -> float:
    """The summed forward and backward of one rank at ``degree``, collectives aside."""
    df = prof.df
    split = (df["tp_role"] != "replicated").to_numpy()
    total = (df["fwd_ms"] + df["bwd_ms"]).to_numpy()
    return float(total[~split].sum() + total[split].sum() / degree)


def test_a_free_link_halves_the_tp_work() -> None:
    prof = _blocks()
    one = partition(prof, stages=1, devices=1, bandwidth=None, **ONE)
    two = partition(prof, stages=1, devices=2, tensor_parallel=2, bandwidth=None, **ONE)
    assert one.iteration_time == pytest.approx(_work(prof, 1))
    assert two.iteration_time == pytest.approx(_work(prof, 2))
    assert (two.tensor_parallel, two.num_stages, two.data_parallel) == (2, 1, 1)


def test_sequence_parallelism_splits_the_rest_of_the_work_and_its_activations() -> None:
    prof = _tokens()
    plain = partition(prof, stages=1, devices=2, tensor_parallel=2, bandwidth=None, **ONE)
    tokens = partition(prof, stages=1, devices=2, tensor_parallel=2, bandwidth=None, sequence_parallel=True, **ONE)
    replicated = prof.df["tp_role"] == "sequence"
    total = prof.df["fwd_ms"] + prof.df["bwd_ms"]
    assert plain.iteration_time == pytest.approx(float(total[~replicated].sum() / 2 + total[replicated].sum()))
    assert tokens.iteration_time == pytest.approx(float(total.sum() / 2))
    assert (plain.sequence_parallel, tokens.sequence_parallel) == (False, True)
    # per block ln's and add's saves halve (OUT each), the rest as it was
    saved = plain.breakdown[0].activation_bytes - tokens.breakdown[0].activation_bytes
    assert saved == 4 * 2 * OUT // 2
    assert "split by tokens too" in tokens.explain() and "split by tokens" not in plain.explain()


def test_sequence_parallelism_in_the_json_and_the_command_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    prof = _tokens()
    plan = partition(prof, stages=2, devices=4, tensor_parallel=2, bandwidth=1e6, chunks=4,
                     sequence_parallel=True, progress=False)
    assert Plan.load(plan.save(tmp_path / "sp.json")) == plan
    again = Plan.from_stages(plan.profile_for(prof), plan.stages, devices=plan.devices, chunks=plan.chunks,
                             recompute=plan.recompute, bandwidth=plan.bandwidth)
    assert again.stage_memory == plan.stage_memory and again.iteration_time == pytest.approx(plan.iteration_time)
    csv = prof.save(tmp_path / "tokens")
    out = tmp_path / "plan.json"
    assert main(["partition", str(csv), "--devices", "4", "--tensor-parallel", "2", "--sequence-parallel",
                 "--out", str(out)]) == 0
    assert Plan.load(out).sequence_parallel
    capsys.readouterr()
    assert main(["partition", str(csv), "--devices", "4", "--sequence-parallel"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give tensor_parallel >= 2" in err
    assert main(["partition", str(_blocks().save(tmp_path / "old")), "--devices", "4", "--tensor-parallel", "2",
                 "--sequence-parallel"]) == 2
    assert "marks no layer 'sequence'" in capsys.readouterr().err


def test_the_all_reduces_lie_on_the_critical_path() -> None:
    prof = _blocks()
    bandwidth = 1e6  # 1e-3 ms a byte; ring over 2: (2 - 1) / 2 x 2 x bytes
    plan = partition(prof, stages=1, devices=2, tensor_parallel=2, bandwidth=bandwidth, **ONE)
    # per block: the row's output forward, the column's input (ln's output) backward
    assert plan.iteration_time == pytest.approx(_work(prof, 2) + 4 * (OUT + OUT) * 1e-3)


def test_auto_is_the_fastest_fixed_degree() -> None:
    prof = _blocks()
    kw = dict(devices=8, stages="auto", chunks="auto", batch_size=32, bandwidth=2e5, progress=False)
    fixed = {t: partition(prof, tensor_parallel=t, **kw) for t in (1, 2, 4, 8)}
    chosen = partition(prof, tensor_parallel="auto", **kw)
    best = min(fixed.values(), key=lambda p: (p.iteration_time, p.tensor_parallel))
    assert chosen.iteration_time == pytest.approx(best.iteration_time)
    assert chosen.tensor_parallel == best.tensor_parallel
    others = {a.tensor_parallel: a.iteration_time for a in chosen.alternatives if a.note.startswith("best with TP")}
    assert others == pytest.approx({t: p.iteration_time for t, p in fixed.items() if t != chosen.tensor_parallel})
    text = chosen.explain()
    assert f"x TP {chosen.tensor_parallel} x DP 1" in text and "| TP | stages |" in text


def test_tp_fits_where_one_device_does_not() -> None:
    prof = _blocks()
    need = {t: max(partition(prof, stages=1, devices=t, tensor_parallel=t, **ONE).stage_memory)
            for t in (1, 2)}
    assert need[2] < need[1]
    limit = (need[1] + need[2]) // 2
    with pytest.raises(PartitionError):
        partition(prof, stages=1, devices=1, memory_limit=limit, **ONE)
    plan = partition(prof, stages=1, devices=2, tensor_parallel="auto", memory_limit=limit, **ONE)
    assert plan.tensor_parallel == 2 and "TP 1 left out" in plan.solver.status


def test_replicas_of_a_tp_pipeline_take_the_rest_of_the_devices() -> None:
    plan = partition(_blocks(), devices=8, stages=2, tensor_parallel=2, data_parallel=2, batch_size=32,
                     chunks=4, progress=False)
    assert (plan.num_stages, plan.tensor_parallel, plan.data_parallel) == (2, 2, 2)
    assert [d.name for d in plan.devices] == ["stage0", "stage2"]  # TP groups of neighbours
    assert "Mesh: PP 2 x TP 2 x DP 2 = 8 devices" in plan.explain()


def test_the_plan_recomputes_from_its_profile() -> None:
    prof = _blocks()
    plan = partition(prof, stages=2, devices=4, tensor_parallel=2, bandwidth=1e6, chunks=4, progress=False)
    again = Plan.from_stages(plan.profile_for(prof), plan.stages, devices=plan.devices, chunks=plan.chunks,
                             recompute=plan.recompute, bandwidth=plan.bandwidth)
    assert again.iteration_time == pytest.approx(plan.iteration_time)
    assert again.stage_memory == plan.stage_memory
    assert simulate(plan, prof).iteration_time == pytest.approx(plan.iteration_time)


def test_the_degree_is_in_the_json_and_older_plans_load_as_one(tmp_path: Path) -> None:
    plan = partition(_blocks(), stages=2, devices=4, tensor_parallel=2, chunks=4, progress=False)
    path = plan.save(tmp_path / "tp.json")
    assert Plan.load(path) == plan and Plan.load(path).tensor_parallel == 2
    data = json.loads(path.read_text())
    del data["tensor_parallel"]
    for a in data["alternatives"]:
        a.pop("tensor_parallel", None)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").tensor_parallel == 1
    data["tensor_parallel"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="'tensor_parallel' must be an integer >= 1"):
        Plan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("kw, match", [
    (dict(devices=8, tensor_parallel=4, devices_per_host=2), "spans hosts of 2 devices"),
    (dict(devices=6, tensor_parallel=3), "does not divide the 8 features of group mlp:b0.row"),
    (dict(devices=6, tensor_parallel=4), "does not divide the 6 devices"),
    (dict(stages=2, tensor_parallel="auto"), "pass devices=N"),
    (dict(devices=4, devices_per_host=0), "devices_per_host=0: need an integer >= 1"),
    (dict(devices=4, tensor_parallel=2.0), "need an integer degree >= 1"),
])
def test_bad_input_is_one_line(kw: dict[str, object], match: str) -> None:
    with pytest.raises(PartitionError, match=match) as err:
        partition(_blocks(), progress=False, **kw)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_a_model_without_structure_refuses_a_degree_and_auto_plans_one() -> None:
    flat = chain_profile([1.0] * 6, output_bytes=OUT)
    flat.df["tp_role"] = "replicated"
    with pytest.raises(PartitionError, match="no tensor-parallel structure"):
        partition(flat, devices=2, tensor_parallel=2, progress=False)
    assert partition(flat, devices=2, stages=2, tensor_parallel="auto", progress=False).tensor_parallel == 1
    with pytest.raises(PartitionError, match=r"^sequence_parallel=True: the model has no tensor-parallel "
                                             r"structure, so no TP group to split its tokens over; use "
                                             r"sequence_parallel=False$"):
        partition(flat, devices=2, stages=2, tensor_parallel="auto", sequence_parallel=True, progress=False)
    older = chain_profile([1.0] * 6, output_bytes=OUT)  # no tp columns at all
    with pytest.raises(PartitionError, match="records no tensor-parallel roles"):
        partition(older, devices=2, tensor_parallel=2, progress=False)


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    csv = _blocks().save(tmp_path / "blocks")
    out = tmp_path / "plan.json"
    assert main(["partition", str(csv), "--devices", "4", "--tensor-parallel", "2", "--out", str(out)]) == 0
    assert Plan.load(out).tensor_parallel == 2 and "TP 2" in capsys.readouterr().out
    assert main(["partition", str(csv), "--devices", "6", "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not divide the 8 features" in err
    assert main(["partition", str(csv), "--devices", "4", "--tensor-parallel", "two"]) == 2
    assert "--tensor-parallel 'two': give a whole number >= 1 or auto" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["exact", "auto", "ilp", "uniform", "params", "step"])
def test_no_stage_boundary_falls_inside_a_tp_group(method: str) -> None:
    # a cut between a group's column and row Linears would carry split values, which the runtime
    # refuses: the solvers keep each group on one stage, as ties="colocate" keeps a tie group
    prof = _blocks(4)
    inside = {f"l{5 * b + i}" for b in range(4) for i in (2, 3)}  # a stage starting at act or row
    free = partition(prof, stages=8 if method != "params" else 7, method=method, **ONE)
    assert {s[0] for s in free.stages} & inside  # without TP the split does cut inside
    plan = partition(prof, stages=8 if method != "params" else 7, tensor_parallel=2, method=method, **ONE)
    assert not {s[0] for s in plan.stages} & inside, plan.stages
    with pytest.raises(PartitionError, match=r"keeping TP groups whole leaves 11 places to cut but 13 "
                                             r"stages need 12; use fewer stages$"):
        partition(prof, stages=13, tensor_parallel=2, method="exact", **ONE)


def test_a_baseline_that_cannot_keep_the_groups_whole_says_so_in_one_line() -> None:
    with pytest.raises(PartitionError, match=r"method='uniform' cannot split 20 layers into 11 stages without "
                                             r"cutting a TP group.*method='exact'$"):
        partition(_blocks(4), stages=11, tensor_parallel=2, method="uniform", **ONE)


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "auto"])
def test_a_search_of_interleaved_stages_takes_two_a_rank(schedule: str) -> None:
    # stages=4 on TP 2 x DP 2 of 8 devices leaves each replica 2 ranks: interleaved, two stages
    # each, as the runtime places them (a search refused it: "stages=4 but only 2 devices")
    kw = dict(stages=4, devices=8, tensor_parallel=2, data_parallel=2, batch_size=32, progress=False)
    plan = partition(_tokens(8), chunks="auto", schedule=schedule, **kw)  # type: ignore[arg-type]
    assert plan.schedule == "interleaved1f1b" and plan.num_stages == 4
    assert [d.name for d in plan.devices] == ["stage0", "stage2", "stage0", "stage2"]
    fixed = partition(_tokens(8), chunks=plan.chunks, schedule="interleaved1f1b", **kw)  # type: ignore[arg-type]
    assert plan.iteration_time == pytest.approx(fixed.iteration_time)
    with pytest.raises(PartitionError, match=r"stages=6 with data_parallel=2 needs 6 devices, got 4; give more devices or stages <= 4$"):
        partition(_tokens(8), chunks="auto", schedule=schedule, **{**kw, "stages": 6})  # type: ignore[arg-type]
