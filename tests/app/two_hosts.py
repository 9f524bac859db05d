"""Two hosts on this machine: two network namespaces joined by a veth pair.

    with two_hosts() as hosts:          # pytest.skip(reason) where namespaces are not permitted
        a, b = hosts.run_on_both(lambda host: [sys.executable, "-m", "autopipe.app.cli", ...])
        with hosts.slow_link("200mbit"):
            ...

Host A is 10.77.0.1 on one end of the pair, host B 10.77.0.2 on the other; each sees only its
own end and its loopback, so every byte between the ranks of a launch across them crosses the
veth. Both share this machine's hostname, which resolves to neither address: each host's
processes get ``GLOO_SOCKET_IFNAME`` (gloo's own connections) and the launch's ``--local-addr``
(torchrun's MASTER_ADDR), the veth of that host. ``tc ... netem`` (a delay) is not available
on this kernel; ``tbf`` (a rate limit) is, on each end so that both directions are slow.
Names carry this process's id and a random suffix; the namespaces (with the veth in them) are
removed on leaving, after ending what still runs in them, also when a test failed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.77.0"


@dataclass(frozen=True)
class Host:
    namespace: str
    veth: str
    addr: str
    node_rank: int


@dataclass(frozen=True)
class Done:
    host: Host
    returncode: int
    stdout: str
    stderr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class TwoHosts:
    a: Host
    b: Host

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def env(self, host: Host) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": host.veth, "OMP_NUM_THREADS": "1"}

    def run_on_both(self, command: Callable[[Host], list[str]], timeout: float = 90.0,
                    cwd: Path | None = None, ahead: bool = False) -> tuple[Done, Done]:
        """``command(host)`` in each namespace at once; both results, or an AssertionError with
        both outputs when they have not ended after ``timeout`` seconds (both are stopped).
        ``ahead``: at nice -10 (the namespaces need root, which may raise a priority), so that a
        measurement of the link sees the CPU a dedicated host would give its ranks, not what the
        parallel suite's other worker leaves them ([Note: slow files first] in tests/xdist_order.py)."""
        nice = ["nice", "-n", "-10"] if ahead and shutil.which("nice") else []
        procs = [subprocess.Popen([*nice, "ip", "netns", "exec", h.namespace, *command(h)], env=self.env(h), cwd=cwd,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True) for h in self.hosts]
        deadline = time.monotonic() + timeout
        outs: list[tuple[str, str]] = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1.0)))
        except subprocess.TimeoutExpired:
            for p in procs:
                _stop(p)
            left = [p.communicate() for p in procs]
            raise AssertionError(f"no result after {timeout:.0f}s:\n" + "\n".join(
                f"--- {h.namespace}\n{o[-3000:]}\n{e[-3000:]}" for h, (o, e) in zip(self.hosts, left, strict=True))) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    _stop(p)
        a, b = (Done(h, p.returncode, o, e) for h, p, (o, e) in zip(self.hosts, procs, outs, strict=True))
        return a, b

    @contextlib.contextmanager
    def slow_link(self, rate: str) -> Iterator[None]:
        """Both ends of the veth limited to ``rate`` (tc's tbf, e.g. "200mbit"); skips the test
        where tc or tbf is missing. Removed on leaving."""
        if shutil.which("tc") is None:
            pytest.skip("`tc` (iproute2) is not installed: no rate limit on the link")
        added: list[Host] = []
        try:
            for h in self.hosts:
                done = subprocess.run(["tc", "-n", h.namespace, "qdisc", "add", "dev", h.veth, "root", "tbf",
                                       "rate", rate, "burst", "32kbit", "latency", "400ms"],
                                      capture_output=True, text=True, timeout=20, check=False)
                if done.returncode:
                    pytest.skip(f"tc cannot rate-limit the veth ({done.stderr.strip()})")
                added.append(h)
            yield
        finally:
            for h in added:
                subprocess.run(["tc", "-n", h.namespace, "qdisc", "del", "dev", h.veth, "root"],
                               capture_output=True, timeout=20, check=False)


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the torchrun and its ranks
    proc.wait(timeout=10)


def _end_what_runs_in(namespace: str) -> None:
    """This test's processes still in ``namespace`` (only ours run there)."""
    done = _ip("netns", "pids", namespace, check=False)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Host A and host B, or pytest.skip with the reason this machine cannot make them."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("network namespaces need root; run as root for the two-host tests")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed: no network namespaces")
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    a = Host(f"autopipe-{tag}-a", f"va{tag}", f"{SUBNET}.1", 0)
    b = Host(f"autopipe-{tag}-b", f"vb{tag}", f"{SUBNET}.2", 1)
    made: list[str] = []
    try:
        for h in (a, b):
            done = _ip("netns", "add", h.namespace, check=False)
            if done.returncode:
                pytest.skip(f"`ip netns add` is not permitted here ({done.stderr.strip()})")
            made.append(h.namespace)
        _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        for h in (a, b):
            _ip("link", "set", h.veth, "netns", h.namespace)
            _ip("-n", h.namespace, "addr", "add", f"{h.addr}/24", "dev", h.veth)
            _ip("-n", h.namespace, "link", "set", h.veth, "up")
            _ip("-n", h.namespace, "link", "set", "lo", "up")
        yield TwoHosts(a, b)
    finally:
        for ns in made:
            _end_what_runs_in(ns)
            _ip("netns", "del", ns, check=False)  # the veth goes with it
        _ip("link", "del", a.veth, check=False)  # where it never moved into a namespace
