"""More than one node without launching one: the node flags, the torchrun lines they make, what a
node's ranks check of each other, and the link file of `autopipe comm` (launched across two
hosts in tests/app/test_two_hosts.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import autopipe
from autopipe.app import rank_main
from autopipe.app.cli import main
from autopipe.app.comm_job import summary
from autopipe.app.config import CommConfig, RunConfig
from autopipe.app.launch import torchrun_command
from autopipe.app.torchrun import diagnose, ranks_command
from autopipe.errors import BuildError, ProfileError
from autopipe.frontend.profiling.spawned.comm import (
    COMM_REPEATS,
    COMM_SIZES,
    load_comm,
    measure_comm_on_ranks,
)

NODES = ["--nnodes", "2", "--rdzv-endpoint", "node0:29500"]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["run", "mlp", "--node-rank", "0"],
         "--node-rank 0 without --nnodes: one host runs torchrun --standalone; pass --nnodes N (the number of "
         "hosts) with it, or leave it out"),
        (["run", "mlp", "--rdzv-endpoint", "node0:29500"], "--rdzv-endpoint node0:29500 without --nnodes: "),
        (["run", "mlp", "--local-addr", "10.0.0.2"], "--local-addr 10.0.0.2 without --nnodes: "),
        (["run", "mlp", "--nnodes", "0"], "--nnodes 0 < 1: pass --nnodes 1 (this host) or the number of hosts"),
        (["run", "mlp", "--plan", "p.json", "--nnodes", "2"],
         "--nnodes 2 needs --rdzv-endpoint HOST:PORT, an address of node 0 that every node reaches, e.g. "
         "--rdzv-endpoint node0:29500"),
        (["run", "mlp", "--plan", "p.json", *NODES, "--node-rank", "2"],
         "--node-rank 2 is not a node of --nnodes 2; pass 0 to 1 (0 on the node at --rdzv-endpoint)"),
        (["run", "mlp", "--plan", "p.json", *NODES, "--node-rank", "-1"], "--node-rank -1 is not a node of "),
        (["run", "mlp", "--plan", "p.json", *NODES, "--nproc", "3"],
         "--nproc 3 ranks do not split evenly over --nnodes 2; pass --nproc a multiple of 2 (the ranks of all "
         "nodes, the same number on each)"),
        (["run", "mlp", *NODES],
         "--nnodes 2 without --plan: each node would profile and partition on its own, into plans that can "
         "differ; make one (`autopipe partition PROFILE --stages K --out plans/NAME.json`) and pass --plan "
         "with a copy on every node"),
        (["run", "mlp", "--plan", "p.json", *NODES, "--local-addr", "a b"], "--local-addr 'a b' is not an address"),
        (["comm", "--out", "c.json", "--nnodes", "3", "--rdzv-endpoint", "node0:29500"],
         "--nnodes 3: the link is timed by two ranks, both on this host (--nnodes 1) or one on each of two "
         "(--nnodes 2)"),
        (["comm", "--out", "c.json", "--node-rank", "1"], "--node-rank 1 without --nnodes: "),
        (["comm", "--out", "c.json", "--sizes", "4096"],
         "--sizes '4096': give 2 or more different byte counts >= 4, comma-separated, e.g. 64,65536,1048576"),
        (["comm", "--out", "c.json", "--sizes", "64,64"], "--sizes '64,64': give 2 or more different"),
        (["comm", "--out", "c.json", "--repeats", "0"], "--repeats 0 < 1: pass --repeats 1 or more"),
    ],
)
def test_bad_node_flags_are_one_line_before_anything_starts(argv: list[str], line: str, no_launch: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autopipe: error: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize("endpoint", ["node0", "node0:", ":29500", "node0:0", "node0:65536", "node 0:29500",
                                      "node0:http", "[::1]29500"])
def test_a_bad_endpoint_is_one_line(endpoint: str, no_launch: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "mlp", "--plan", "p.json", "--nnodes", "2", "--rdzv-endpoint", endpoint]) == 2
    assert capsys.readouterr().err == (
        f"autopipe: error: --rdzv-endpoint {endpoint!r} is not HOST:PORT; pass node 0's address and a free port "
        "there (1-65535), e.g. --rdzv-endpoint node0:29500\n")


def test_each_node_starts_its_share_of_a_c10d_rendezvous(tmp_path: Path) -> None:
    config = RunConfig("mlp", plan="plans/mlp.json", nproc=4, nnodes=2, node_rank=0,
                       rdzv_endpoint="[fd00::1]:29500", local_addr="10.0.0.1")
    cmd = torchrun_command(config, tmp_path)
    assert cmd[:8] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                       "--rdzv-backend=c10d", "--rdzv-endpoint=[fd00::1]:29500", "--rdzv-conf=is_host=true"]
    assert cmd[8] == "--local-addr=10.0.0.1" and "--standalone" not in cmd
    assert RunConfig.from_json(cmd[cmd.index("--config") + 1]) == config  # what every rank reads
    other = torchrun_command(dataclasses.replace(config, node_rank=1, local_addr=None), tmp_path)
    assert "--rdzv-conf=is_host=false" in other and not any(a.startswith("--local-addr") for a in other)
    guessed = torchrun_command(dataclasses.replace(config, node_rank=None), tmp_path)
    assert not any(a.startswith("--rdzv-conf") for a in guessed)  # torchrun matches the host itself
    comm = ranks_command(CommConfig(out="c.json", nnodes=2, rdzv_endpoint="node0:29500"), 2,
                         "autopipe.app.comm_job", None)
    assert "--nproc_per_node=1" in comm and comm[comm.index("-m", 3) + 1] == "autopipe.app.comm_job"
    alone = ranks_command(CommConfig(out="c.json"), 2, "autopipe.app.comm_job", None)
    assert alone[3:5] == ["--standalone", "--nproc_per_node=2"]


_ROOT = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_03:10:20
  host      : node1
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 14114)
"""


def test_a_nodes_diagnosis_names_the_global_rank_and_this_nodes_log(tmp_path: Path) -> None:
    logs = {0: "", 1: "Traceback (most recent call last):\nRuntimeError: out of memory\n"}
    assert diagnose(logs, _ROOT, 4, tmp_path, nodes=2) == (
        f"rank 3 exited with status 1: RuntimeError: out of memory; its log is {tmp_path / 'local_rank1.log'}")
    own = {0: "autopipe comm: error on rank 2: the link measurement needs 2 ranks\n"}
    assert diagnose(own, "", 2, tmp_path, nodes=2) == (
        f"rank 2: the link measurement needs 2 ranks; this node's ranks' logs are in "
        f"{tmp_path}")


def _gathered(monkeypatch: pytest.MonkeyPatch, ranks: list[RunConfig]) -> None:
    """dist.all_gather_object as if rank r had been started with ``ranks[r]``."""
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: len(ranks))

    def gather(out: list[object], mine: object) -> None:
        for r, config in enumerate(ranks):
            flags = {**dataclasses.asdict(config), **rank_main.NODE_OWN}
            out[r] = (flags, autopipe.Plan.load(config.plan).to_dict() if config.plan else None)

    monkeypatch.setattr(dist, "all_gather_object", gather)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("plans")
    ex = autopipe.get_example("mlp", batch_size=16)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=1, warmup=0)
    return (autopipe.partition(prof, stages=2).save(out / "a.json"),
            autopipe.partition(prof, stages=3).save(out / "b.json"))


def test_every_rank_checks_the_others_train_the_same(monkeypatch: pytest.MonkeyPatch,
                                                     plans: tuple[Path, Path], tmp_path: Path) -> None:
    one = RunConfig("mlp", plan=str(plans[0]), nproc=2, nnodes=2, node_rank=0, rdzv_endpoint="n0:1", local_addr="a")
    copy = tmp_path / "copy.json"  # the same plan in another file, another node's own flags: agreed
    copy.write_text(plans[0].read_text())
    _gathered(monkeypatch, [one, dataclasses.replace(one, plan=str(copy), node_rank=1, local_addr="b", threads=4)])
    rank_main.check_same_run(one)
    _gathered(monkeypatch, [one, dataclasses.replace(one, steps=5, lr=0.1)])
    with pytest.raises(BuildError, match=r"^rank 1 was started with --steps 5 \(rank 0: 10\), --lr 0.1 \(rank 0: "
                                         r"0.001\); run the same `autopipe run` command line on every node, with "
                                         r"a copy of the same plan$"):
        rank_main.check_same_run(one)
    _gathered(monkeypatch, [one, one, dataclasses.replace(one, plan=str(plans[1]))])
    with pytest.raises(BuildError, match=r"^rank 2 was started with another plan \(its --plan file differs "):
        rank_main.check_same_run(one)


def test_the_link_file_is_checked_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.json"
    with pytest.raises(ProfileError, match=r"none.json: no such file; measure the link first: `autopipe comm"):
        load_comm(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"bad.json is not a link measurement \(.*\); re-run `autopipe comm "):
        load_comm(bad)
    bad.write_text(json.dumps({"comm_backend": "gloo"}))
    with pytest.raises(ProfileError, match=r"bad.json is not a link measurement of `autopipe comm`: it lacks "
                                           r"comm_latency_ms, comm_bandwidth, "):
        load_comm(bad)
    assert main(["profile", "mlp", "--comm", "--comm-from", str(bad), "--out", str(tmp_path / "p.csv")]) == 2
    assert capsys.readouterr().err == (f"autopipe: error: --comm and --comm-from {bad}: pass one; --comm measures "
                                       "two ranks on this host, --comm-from takes the link `autopipe comm` measured\n")
    assert main(["profile", "mlp", "--comm-from", str(missing), "--out", str(tmp_path / "p.csv")]) == 2
    assert "no such file; measure the link first" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()  # refused before measuring


def test_comm_defaults_are_the_measurements_and_it_needs_a_group_of_two() -> None:
    config = CommConfig(out="c.json")
    assert config.byte_sizes() == list(COMM_SIZES) and config.repeats == COMM_REPEATS
    with pytest.raises(ProfileError, match=r"^measure_comm_on_ranks needs a process group of 2 ranks, got no "
                                           r"process group; launch two ranks"):
        measure_comm_on_ranks()
    line = summary({"comm_nodes": 2, "comm_backend": "gloo", "comm_latency_ms": 0.05, "comm_bandwidth": 12.5e6,
                    "stage_call_fwd_ms": 0.2, "stage_call_bwd_ms": 0.3})
    assert line == "between two ranks on 2 nodes (gloo): 0.05 ms + bytes / 11.9 MiB/s; 0.2 + 0.3 ms per stage call"


def test_comm_refuses_to_overwrite_before_launching(tmp_path: Path, no_launch: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.json"
    out.write_text("{}")
    assert main(["comm", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"autopipe: error: {out} already exists: refusing to overwrite a link "
                                       "measurement; pass --force or choose another --out\n")


def test_a_temporary_log_folder_goes_after_a_clean_launch_and_stays_otherwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`autopipe comm`'s default log folder (torchrun's logs, the ranks' stderr) is removed when
    nothing is left to read there; a folder the caller named, a launch whose ranks wrote more
    than is echoed, and a failed launch keep theirs (and name it)."""
    import os

    from autopipe.app.torchrun import RankFailure, launch_ranks

    def launch(work: Path, code: int = 0, *, temporary: bool = True) -> int:
        work.mkdir(exist_ok=True)
        return launch_ranks([sys.executable, "-c", f"raise SystemExit({code})"], work, 1, nodes=1, world=1,
                            env=dict(os.environ), timeout=60, temporary=temporary)

    assert launch(tmp_path / "clean") == 0 and not (tmp_path / "clean").exists()
    assert launch(tmp_path / "named", temporary=False) == 0 and (tmp_path / "named").exists()
    noisy = tmp_path / "noisy"
    (noisy / "torchrun" / "run" / "attempt_0" / "0").mkdir(parents=True)
    (noisy / "torchrun" / "run" / "attempt_0" / "0" / "stderr.log").write_text(
        "\n".join(f"warning {i}" for i in range(12)))
    capsys.readouterr()
    assert launch(noisy) == 0 and (noisy / "rank0.log").exists()
    assert f"4 more line(s) of the ranks' stderr in {noisy}" in capsys.readouterr().err
    with pytest.raises(RankFailure):
        launch(tmp_path / "failed", 1)
    assert (tmp_path / "failed" / "torchrun.log").exists()
