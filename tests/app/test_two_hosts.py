"""More than one host: launches across two network namespaces joined by a veth (tests/app/two_hosts.py).

One torchrun per host, ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.77.0.1:PORT``, as
`autopipe run` / `autopipe comm --nnodes 2` start them on each node; every byte between the
ranks crosses the veth. Skipped (with the reason) where namespaces are not permitted.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import autopipe
from autopipe.app.cli import main
from autopipe.app.config import RunConfig
from autopipe.app.launch import prepare, torchrun_command
from autopipe.app.model_spec import load_model
from autopipe.frontend.profiling.spawned.comm import load_comm, with_comm
from tests.app import two_hosts as two_hosts_module
from tests.app.two_hosts import Host, TwoHosts, two_hosts

STEPS = 4
SLOW = "100mbit"  # tc's rate: 12.5e6 bytes/s
SLOW_SIZES = ["--sizes", "64,65536,524288"]  # up to 512 KiB a crossing: 42 ms each on the slow link


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as made:
        yield made


@pytest.mark.parametrize(("patch", "reason"), [
    ({"geteuid": lambda: 1000}, "network namespaces need root; run as root for the two-host tests"),
    ({"which": lambda name: None}, "`ip` (iproute2) is not installed: no network namespaces"),
])
def test_without_namespaces_the_tests_skip_with_the_reason(patch: dict[str, object], reason: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in patch.items():
        monkeypatch.setattr(two_hosts_module.os if name == "geteuid" else two_hosts_module.shutil, name, value)
    with pytest.raises(pytest.skip.Exception, match=re.escape(reason)), two_hosts():
        raise AssertionError("made namespaces")


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step +\d+/\d+ +loss (\S+)", text, flags=re.M)]


def _one_process_losses(chunks: int, batch: int) -> list[float]:
    """rank_main's loop on the plain model: AdamW on the mean micro-batch loss of each step's
    batch ([Note: a batch per step] in autopipe/examples.py)."""
    ex = load_model("mlp", batch, for_training="the reference")
    assert ex.loss_fn is not None
    opt = torch.optim.AdamW(ex.model.parameters(), lr=RunConfig("mlp").lr)
    losses = []
    for step in range(STEPS):
        (x,), y = ex.batch(step)
        xs, ys = x.tensor_split(chunks), y.tensor_split(chunks)
        opt.zero_grad()
        loss = torch.stack([ex.loss_fn(ex.model(x), y) for x, y in zip(xs, ys, strict=True)]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_stages_on_two_hosts_train_as_one_process(hosts: TwoHosts, tmp_path: Path) -> None:
    ex = autopipe.get_example("mlp", batch_size=16)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=1, warmup=0)
    plan = autopipe.partition(prof, stages=2).save(tmp_path / "mlp2.json")
    # what `autopipe run mlp --plan ... --nnodes 2 --node-rank R ...` checks, then starts on node R
    config = RunConfig("mlp", plan=str(plan), nproc=2, steps=STEPS, timeout=30, nnodes=2,
                       rdzv_endpoint=f"{hosts.a.addr}:29501")
    resolved, _, _ = prepare(config, tmp_path)

    def on(host: Host) -> list[str]:
        mine = dataclasses.replace(resolved, node_rank=host.node_rank, local_addr=host.addr)
        cmd = torchrun_command(mine, tmp_path / host.namespace)
        assert "--nnodes=2" in cmd and "--standalone" not in cmd and "--nproc_per_node=1" in cmd
        return cmd

    a, b = hosts.run_on_both(on)
    for done in (a, b):
        assert done.returncode == 0, f"{done.host.namespace}: {done.stderr[-3000:]}"
    # each host ran one rank: stage 1's, the one that prints the losses, on one of them
    printed = [d for d in (a, b) if _losses(d.stdout)]
    assert len(printed) == 1, (a.stdout, b.stdout)
    losses = _losses(printed[0].stdout)
    expected = _one_process_losses(resolved.chunks or 4, resolved.batch_size or 16)
    print(f"\nlosses on two hosts {losses}, one process {[round(v, 6) for v in expected]}")
    assert len(losses) == STEPS
    assert_close(losses, expected, rtol=0, atol=6e-5)  # printed with 4 decimals


def _fast_link(hosts: TwoHosts, tmp_path: Path) -> tuple[dict[str, object], Path]:
    """The veth measured (the default sizes, up to 4 MiB), again (at most twice) while it looks
    like a host too busy to measure it, and the least busy of the measurements: beside the
    parallel suite's other worker the two hosts' ranks once waited so long for the CPU that a
    crossing of the veth fitted tens of ms and its empty stage calls as much, which no link
    between two namespaces costs (an idle veth: 0.05-0.08 ms, 0.2-0.5 ms a call). The ranks run
    at nice -10 (``ahead``) for the same reason. Under the suite the veth still measures 1.4-1.8
    ms of latency, where two stages of ``make_link_bound`` stay 1.25x ahead (they lose from about
    4.3 ms): measured again from 2 ms. Judged on the measurement alone, never on the plan
    it leads to."""
    def busy(m: dict[str, object]) -> float:  # over 1: too busy to be the veth's measurement
        call = float(m["stage_call_fwd_ms"]) + float(m["stage_call_bwd_ms"])  # type: ignore[arg-type]
        return max(float(m["comm_latency_ms"]) / 2.0, call / 5.0)  # type: ignore[arg-type]

    tried: list[tuple[dict[str, object], Path]] = []
    for attempt in range(3):
        out = tmp_path / f"fast{attempt}"
        tried.append((_measure(hosts, out, 29502 + 2 * attempt), out / hosts.a.namespace / "comm.json"))
        if busy(tried[-1][0]) <= 1.0:
            break
    if len(tried) > 1:
        print(f"\nthe veth measured {len(tried)} times, busy {[round(busy(m), 2) for m, _ in tried]}", end="")
    return min(tried, key=lambda t: busy(t[0]))


def _measure(hosts: TwoHosts, out: Path, port: int, *flags: str) -> dict[str, object]:
    """`autopipe comm --nnodes 2` on both hosts; each writes its own copy of the measurement."""
    def on(host: Host) -> list[str]:
        return [sys.executable, "-m", "autopipe.app.cli", "comm", "--out", str(out / host.namespace / "comm.json"),
                "--nnodes", "2", "--node-rank", str(host.node_rank), "--rdzv-endpoint", f"{hosts.a.addr}:{port}",
                "--local-addr", host.addr, "--repeats", "5", *flags]

    done = hosts.run_on_both(on, ahead=True)
    for d in done:
        assert d.returncode == 0, f"{d.host.namespace}: {d.stderr[-3000:]}"
        assert "between two ranks on 2 nodes (gloo): " in d.stdout, d.stdout
    copies = [json.loads((out / h.namespace / "comm.json").read_text()) for h in hosts.hosts]
    assert copies[0] == copies[1] and copies[0]["comm_nodes"] == 2
    return load_comm(out / hosts.a.namespace / "comm.json")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_comm_measures_the_link_and_a_slow_link_changes_the_plan(hosts: TwoHosts, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fast, fast_file = _fast_link(hosts, tmp_path)
    with hosts.slow_link(SLOW):
        slow = _measure(hosts, tmp_path / "slow", 29503, *SLOW_SIZES)
    # None: the crossings did not grow with the bytes (a veth on a busy host: scheduling noise)
    fast_bw = float(fast["comm_bandwidth"] or "inf")  # type: ignore[arg-type]
    slow_bw = float(slow["comm_bandwidth"])  # type: ignore[arg-type]
    # tbf's rate, as the ranks measured it: a fit of latency + bytes / bandwidth over a few sizes,
    # whose latency term takes part of the time (once 1.11x the rate); the fast link is ~150x
    assert 0.5 < slow_bw / 12.5e6 < 1.5, slow
    assert fast_bw > 20 * slow_bw, (fast, slow)

    # one profile of the model, with each link: the plan changes with the link alone
    out = tmp_path / "link_bound.csv"
    assert main(["profile", "tests.models:make_link_bound", "--batch-size", "4096", "--chunks", "8",
                 "--comm-from", str(fast_file), "--out", str(out),
                 "--repeats", "3", "--warmup", "1", "--no-progress"]) == 0
    assert "between two ranks on 2 nodes (gloo): " in capsys.readouterr().out
    on_fast = autopipe.Profile.load(out)
    on_slow = with_comm(on_fast, measured=slow)
    assert on_fast.corrections.transfer is not None and on_slow.corrections.transfer is not None
    assert on_slow.corrections.transfer.bandwidth == slow_bw
    plans = [autopipe.partition(p, stages="auto", devices=2, progress=False) for p in (on_fast, on_slow)]
    others = [autopipe.partition(p, stages=k, progress=False) for p, k in ((on_fast, 1), (on_slow, 2))]
    with capsys.disabled():
        for link, p, plan, other in zip(("veth", f"{SLOW} tbf"), (fast, slow), plans, others, strict=True):
            bw = float(p["comm_bandwidth"] or "inf") / 2**20  # type: ignore[arg-type]
            print(f"\n{link}: {bw:.1f} MiB/s, latency {p['comm_latency_ms']} ms, empty calls "
                  f"{p['stage_call_fwd_ms']} + {p['stage_call_bwd_ms']} ms: {plan.num_stages} stage(s) "
                  f"{plan.spans()} {plan.iteration_time:.2f} ms (with {other.num_stages}: "
                  f"{other.iteration_time:.2f} ms)", end="")
    if (plans[0].num_stages, plans[1].num_stages) != (2, 1):  # all of it: pytest cuts a long repr
        raise AssertionError("\n".join([f"stages {plans[0].num_stages}, {plans[1].num_stages} (want 2, 1)",
                                        f"veth measured: {fast}", f"tbf measured: {slow}",
                                        f"profile's corrections: {on_fast.corrections}",
                                        plans[0].explain(), others[0].explain(), plans[1].explain()]))
