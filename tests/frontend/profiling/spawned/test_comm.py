"""[Note: measured transfer]: the fit, the metadata a profile keeps, and one real 2-rank run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopipe.app.cli import main
from autopipe.core.corrections import Corrections, Phases
from autopipe.core.cost import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.simulator import simulate_stages
from autopipe.core.stage_cost import StageCost
from autopipe.frontend.profiling.spawned import comm, comm_fit, rank_contention
from autopipe.solvers.synthetic import random_chain
from tests.frontend.profiling.spawned.beside import BesideTimer, watch_twins
from tests.frontend.profiling.spawned.fake_link import FakeLink


def test_the_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [64, 64 << 10, 512 << 10, 4 << 20]
    exact = [0.05 + n / 4e6 for n in sizes]  # 0.05 ms + bytes at 4 GB/s
    latency, bandwidth = comm_fit.fit_transfer(sizes, exact)
    assert latency == pytest.approx(0.05) and bandwidth == pytest.approx(4e9)
    noisy = [t * f for t, f in zip(exact, [1.1, 0.9, 1.05, 0.95], strict=True)]
    latency, bandwidth = comm_fit.fit_transfer(sizes, noisy)
    assert 0.04 < latency < 0.06 and 3e9 < bandwidth < 5e9  # relative errors: small sizes count
    assert comm_fit.fit_transfer([64, 1 << 20], [0.1, 0.1]) == (pytest.approx(0.1), math.inf)
    assert comm_fit.fit_transfer([64, 1 << 20], [0.1, 0.01])[1] == math.inf  # never below 0
    assert comm_fit.fit_transfer([64, 1 << 20], [0.0001, 1.0])[0] >= 0.0


MEASURED = {"comm_backend": "gloo", "comm_latency_ms": 0.07, "comm_bandwidth": 3e9,
            "comm_sizes": [64, 1024], "comm_ms": [0.07, 0.08], "comm_receive_share": 0.9, "stage_call_fwd_ms": 0.2,
            "stage_call_bwd_ms": 0.3, "stage_call_of": "DistributedPipeline"}


def test_the_measurement_rides_in_the_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(comm, "measure_comm", lambda device, **kw: dict(MEASURED, chunks=kw["chunks"]))
    base = random_chain(6, 1)
    base = Profile(base.df, base.edges, {**base.meta, "chunks": 4, "stage_call_fwd_ms": 0.01,
                                         "stage_call_bwd_ms": 0.02})
    prof = comm.with_comm(base)
    assert prof.meta["chunks"] == 4 and prof.meta["comm_backend"] == "gloo"
    # executor.GPipe's own call cost stays beside the distributed runtime's: nothing renamed
    assert prof.corrections.stage_calls == {"gpipe": {"gpipe": Phases(0.01, 0.02)},
                                            "distributed": {"gpipe": Phases(0.2, 0.3)}}
    path = prof.save(f"{tmp_path}/p.csv")
    costs = LayerCosts.from_profile(Profile.load(path))
    assert (costs.comm_latency_ms, costs.comm_bandwidth, costs.call_fwd_ms) == (0.07, 3e9, 0.2)
    assert costs.comm_receive_share == 0.9


def test_profile_comm_on_the_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(comm, "measure_comm", lambda device, **kw: dict(MEASURED))
    out, plan = tmp_path / "chain.csv", tmp_path / "plan.json"
    argv = ["profile", "tests.models:make_chain", "--out", str(out), "--repeats", "2", "--warmup", "0"]
    assert main([*argv, "--comm"]) == 0
    assert "between two ranks (gloo): 0.07 ms + bytes / 2.8 GiB/s, the receiver 0.9 x the bytes' time again" \
        in capsys.readouterr().out
    assert main(["partition", str(out), "--stages", "2", "--out", str(plan)]) == 0
    assert Plan.load(plan).bandwidth == 3e9  # the measured bandwidth, not the default 1e10
    assert main(["partition", str(out), "--stages", "2", "--out", str(plan), "--force",
                 "--bandwidth", "0"]) == 0
    assert Plan.load(plan).bandwidth is None


def test_crossings_from_the_median_launch_steps_from_the_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    def rank(ms: list[float], late: float, gpipe: float) -> dict[str, object]:
        return {"ms": ms, "late": late, "fwd": 1.0, "gpipe": gpipe, "1f1b": gpipe * 2}

    launches = iter([
        [rank([0.05, 0.30], 1.0, 2.0), rank([0.06, 0.20], 9.0, 2.2)],  # the faster launch
        [rank([0.04, 0.50], 2.0, 3.0), rank([0.05, 0.10], 9.0, 2.9)],
        [rank([0.07, 0.40], 3.0, 2.5), rank([0.01, 0.10], 9.0, 2.4)],
    ])
    monkeypatch.setattr(comm, "_launch", lambda *args: next(launches))
    meta = comm.measure_comm("cpu", chunks=2, sizes=(64, 1 << 20), launches=3)
    assert meta["comm_launches"] == 3
    assert meta["comm_ms"] == [0.06, 0.4]  # each launch's slower rank, then the median launch
    assert meta["comm_late_receive_ms"] == 2.0  # rank 0's late receive, the median launch
    call = comm_fit.fit_call_ms(3.0, "gpipe", 2, meta["comm_latency_ms"], 1000.0 / meta["comm_bandwidth"])
    assert meta["stage_call_fwd_ms"] + meta["stage_call_bwd_ms"] == pytest.approx(call, abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_real_ranks() -> None:
    meta = comm.measure_comm("cpu", chunks=4, sizes=(64, 256 << 10), repeats=3, steps=3, launches=1)
    assert meta["comm_backend"] == "gloo" and meta["comm_latency_ms"] >= 0
    assert len(meta["comm_ms"]) == 2 and all(t > 0 for t in meta["comm_ms"])
    assert meta["stage_call_fwd_ms"] >= 0 and meta["stage_call_bwd_ms"] >= 0
    # the share is the fit of this run's own late receive (the truth of a link: the fake link below)
    ms_per_byte = 1000.0 / meta["comm_bandwidth"] if meta["comm_bandwidth"] else 0.0
    assert meta["comm_receive_share"] == pytest.approx(comm_fit.receive_share(
        meta["comm_late_receive_ms"], max(meta["comm_sizes"]), meta["comm_latency_ms"], ms_per_byte), abs=1e-4)
    assert meta["comm_late_receive_ms"] > 0
    for schedule in comm_fit.SCHEDULE_CALLS:  # 4 chunks: torch runs every schedule on them
        assert meta[f"stage_call_{schedule}_fwd_ms"] >= 0 and meta[f"stage_call_{schedule}_bwd_ms"] >= 0
    calls = Corrections.from_legacy_meta(meta).stage_calls["distributed"]
    assert set(calls) == {"gpipe", *comm_fit.SCHEDULE_CALLS}
    assert all("interleaved1f1b" in comm.timed_schedules(m) for m in (2, 3, 4))
    assert "interleaved1f1b" not in comm.timed_schedules(5)
    # dualpipev needs as many micro-batches as its 4 stages; interleaved ones a multiple of their rounds
    assert comm.timed_schedules(4) == comm_fit.SCHEDULE_CALLS
    assert "dualpipev" not in comm.timed_schedules(2) and "zbv" in comm.timed_schedules(2)
    assert {"interleaved1f1b", "interleaved_zb"}.isdisjoint(comm.timed_schedules(5))


@pytest.mark.parametrize("share", [0.4, 1.0])
def test_a_link_of_known_latency_bandwidth_and_receive_share_is_measured_as_such(
        monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    # 50 us + 1 byte per ns: 4 MiB take 4.19 ms on the wire, less than the receive is posted late
    link = FakeLink(latency_ms=0.05, bytes_per_ms=1e6, receive_share=share)
    monkeypatch.setattr(comm, "dist", link)
    monkeypatch.setattr(comm, "time", link.time)
    monkeypatch.setattr(comm, "_empty_pipeline_ms", lambda *_: {"fwd": 1.0, "gpipe": 2.0})
    ranks = link.run(lambda rank: comm._measure(rank, torch.device("cpu"), comm.COMM_SIZES, 3, 2, 1))
    meta = comm_fit.fit_comm([ranks], "gloo", comm.COMM_SIZES, 2)
    assert meta["comm_ms"] == pytest.approx([0.05 + n / 1e6 for n in meta["comm_sizes"]])
    assert meta["comm_latency_ms"] == pytest.approx(0.05) and meta["comm_bandwidth"] == pytest.approx(1e9)
    assert meta["comm_late_receive_ms"] == pytest.approx(0.05 + share * max(meta["comm_sizes"]) / 1e6)
    assert meta["comm_receive_share"] == pytest.approx(share, abs=1e-4)


@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_the_call_cost_fit_inverts_the_simulator(chunks: int) -> None:
    latency, ms_per_byte = 0.05, 1 / 4e6
    hop = latency + 4 * ms_per_byte
    # GPipe: the closed form of [Note: measured transfer], (M + 1) calls and 2 M crossings
    gpipe = (chunks + 1) * 0.3 + 2 * chunks * hop
    assert comm_fit.fit_call_ms(gpipe, "gpipe", chunks, latency, ms_per_byte) == pytest.approx(0.3, rel=1e-6)
    # 1F1B: its own order, simulated with the fitted call, takes the measured step
    one_f = comm_fit.fit_call_ms(2 * gpipe, "1f1b", chunks, latency, ms_per_byte, fwd_share=0.4)
    stage = StageCost(0.0, 0.0, 0.0, 0.0, 0, 0, input_bytes=4, output_bytes=4, saved_bytes=0,
                      call_fwd_ms=0.4 * one_f, call_bwd_ms=0.6 * one_f, latency_ms=latency)
    again = simulate_stages([stage, stage], chunks=chunks, recompute="never", ms_per_byte=ms_per_byte,
                            schedule="1f1b").iteration_time
    assert one_f > 0.3 and again == pytest.approx(2 * gpipe, rel=1e-6)
    # interleaved: 4 stages, 2 per rank, in torch's interleaved order
    looped = comm_fit.fit_call_ms(3 * gpipe, "interleaved1f1b", chunks, latency, ms_per_byte)
    stage = StageCost(0.0, 0.0, 0.0, 0.0, 0, 0, input_bytes=4, output_bytes=4, saved_bytes=0,
                      call_fwd_ms=0.5 * looped, call_bwd_ms=0.5 * looped, latency_ms=latency)
    again = simulate_stages([stage] * 4, chunks=chunks, recompute="never", ms_per_byte=ms_per_byte,
                            schedule="interleaved1f1b", devices=["a", "b", "a", "b"]).iteration_time
    assert looped > 0 and again == pytest.approx(3 * gpipe, rel=1e-6)
    # ZB-V: 4 stages in a V (rank 0 stages 0 and 3), each backward split in two calls
    v = comm_fit.fit_call_ms(4 * gpipe, "zbv", chunks, latency, ms_per_byte)
    stage = StageCost(0.0, 0.0, 0.0, 0.0, 0, 0, input_bytes=4, output_bytes=4, saved_bytes=0,
                      call_fwd_ms=0.5 * v, call_bwd_ms=0.5 * v, latency_ms=latency, bwd_input_ms=0.0)
    again = simulate_stages([stage] * 4, chunks=chunks, recompute="never", ms_per_byte=ms_per_byte,
                            schedule="zbv", devices=["a", "b", "b", "a"]).iteration_time
    assert v > 0 and again == pytest.approx(4 * gpipe, rel=1e-6)
    assert comm_fit.fit_call_ms(0.0, "1f1b", chunks, latency, ms_per_byte) == 0.0  # faster than free


def test_1f1b_plans_pay_the_call_cost_measured_under_1f1b() -> None:
    base = random_chain(6, 1)
    meta = {**base.meta, **MEASURED, "stage_call_1f1b_fwd_ms": 0.5, "stage_call_1f1b_bwd_ms": 0.7}
    prof = Profile(base.df, base.edges, meta)
    assert LayerCosts.from_profile(prof).call_for("1f1b") == (0.5, 0.7)
    assert LayerCosts.from_profile(prof).call_for("gpipe") == (0.2, 0.3)
    split = [prof.layers[:3], prof.layers[3:]]
    for schedule, want in (("gpipe", (0.2, 0.3)), ("1f1b", (0.5, 0.7))):
        plan = Plan.from_stages(prof, split, chunks=4, schedule=schedule)
        assert {(st.call_fwd_ms, st.call_bwd_ms) for st in plan.breakdown} == {want}
    # interleaved 1F1B: its own where measured, else 1F1B's
    assert LayerCosts.from_profile(prof).call_for("interleaved1f1b") == (0.5, 0.7)
    both = Profile(base.df, base.edges, {**meta, "stage_call_interleaved1f1b_fwd_ms": 0.9,
                                         "stage_call_interleaved1f1b_bwd_ms": 1.1})
    assert LayerCosts.from_profile(both).call_for("interleaved1f1b") == (0.9, 1.1)
    older = Profile(base.df, base.edges, {**base.meta, **MEASURED})  # measured before 1F1B was
    assert LayerCosts.from_profile(older).call_for("1f1b") == (0.2, 0.3)
    assert LayerCosts.from_profile(older).call_for("interleaved1f1b") == (0.2, 0.3)


def test_the_receive_share_is_the_late_receive_beyond_the_latency_over_the_bytes() -> None:
    # 4 MB at 4 GB/s is 1 ms on the wire; a late receive of 1.05 ms with 0.05 ms latency: 1.0
    assert comm_fit.receive_share(1.05, 4_000_000, 0.05, 1 / 4e6) == pytest.approx(1.0)
    assert comm_fit.receive_share(0.01, 4_000_000, 0.05, 1 / 4e6) == 0.0  # faster than the latency
    assert comm_fit.receive_share(50.0, 4_000_000, 0.05, 1 / 4e6) == comm_fit.RECEIVE_SHARE_RANGE[1]  # noise
    assert comm_fit.receive_share(1.0, 4_000_000, 0.05, 0.0) == 0.0  # free transfers: nothing to share


@pytest.mark.slow
def test_a_script_without_a_main_guard_gets_one_line_that_says_so(tmp_path: Path) -> None:
    # the spawned ranks import the script first, which calls measure_comm again while they bootstrap
    script = tmp_path / "unguarded.py"
    script.write_text("from autopipe.errors import ProfileError\n"
                      "from autopipe.frontend.profiling.spawned.comm import measure_comm\n"
                      "try:\n"
                      "    measure_comm('cpu', chunks=2, repeats=1, steps=1)\n"
                      "except ProfileError as err:\n"
                      "    print('ERROR', err, flush=True)\n"
                      "    raise SystemExit(2)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    said = [line for line in run.stdout.splitlines() if line.startswith("ERROR")]
    # the caller (its rank died) and each rank (its own spawn refused while bootstrapping)
    assert run.returncode == 2 and any("ProcessExitedException" in line for line in said), run.stdout + run.stderr
    assert all('under `if __name__ == "__main__":`' in line for line in said), said


def test_profile_comm_measures_the_ranks_slowdown_beside_each_other(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(comm, "measure_comm", lambda device, **kw: dict(MEASURED))
    # the model's steps take 1.25x as long beside a twin (no process forked: the timer says so)
    beside = watch_twins(monkeypatch, fork=False)
    monkeypatch.setattr(rank_contention, "CpuTimer", lambda: BesideTimer(beside, 2.0, 1.25))
    out = tmp_path / "chain.csv"
    assert main(["profile", "tests.models:make_chain", "--out", str(out), "--repeats", "2", "--warmup", "0",
                 "--comm"]) == 0
    assert beside.entered == rank_contention.TWIN_ROUNDS
    assert Profile.load(out).corrections.rank_compute_slowdown == 1.25
    assert "ranks on this host compute 1.25x slower beside each other" in capsys.readouterr().out
