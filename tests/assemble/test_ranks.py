"""executor.ranks.distributed + autopipe.assemble: 2 gloo ranks spawned from pytest vs one process.

Every distributed test runs its ranks on a free local port, with a hard deadline: a hanging
rank is killed and fails the test instead of hanging the suite. Two healthy ranks are shared by
the tests, started once per session ([Note: one pool of ranks]); a test that kills or hangs a
rank spawns fresh processes of its own. The
single-process reference is the mean of ``loss_fn`` over the same micro-batches (see
[Note: loss of a pipeline] in autopipe/assemble/local.py).
"""

from __future__ import annotations

import datetime
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

import autopipe
from autopipe.assemble.ranks import distributed_pipeline, merge_state_dicts
from autopipe.errors import BuildError
from autopipe.frontend.building.stages import RecomputedLayer
from executor.ranks.distributed import (
    DistributedError,
    DistributedPipeline,
    PipelineFailure,
    Wire,
    WireStage,
    infer_wires,
)
from tests import forked
from tests.models import MultiIO, Skip

CHUNKS = 4
Case = tuple[nn.Module, tuple[Tensor, ...], Tensor, Callable[[Any, Any], Tensor]]


# --- spawning ranks ---------------------------------------------------------------------------
@dataclass
class RankResult:
    exitcode: int | None  # None: still running at the deadline, killed by the parent
    value: Any = None
    error: str | None = None  # the rank's traceback when it raised


def _entry(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...],
           group_timeout: float = 30.0) -> None:
    forked.fresh_state()
    torch.set_num_threads(1)
    path = Path(out) / f"{rank}.pt"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=group_timeout))
        torch.save({"value": fn(rank, *args)}, path)
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        torch.save({"error": traceback.format_exc()}, path)
        os._exit(1)
    os._exit(0)  # skip teardown collectives: a peer may already be gone


def spawn(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 45.0,
          fresh: bool = False, group_timeout: float = 30.0) -> list[RankResult]:
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks; kill whatever outlives ``timeout``.

    Two ranks run on the shared pool ([Note: one pool of ranks]) unless ``fresh``: a test that
    kills or hangs a rank, or measures a rank's memory, asks for processes of its own; its
    default group waits ``group_timeout`` seconds for a collective (a build that reads gigabytes
    on a loaded machine asks for more)."""
    if world == 2 and not fresh:
        return _pool_run(fn, args, timeout)
    ctx = forked.context()  # [Note: processes forked from a server] in tests/forked.py
    with tempfile.TemporaryDirectory() as out:
        port = forked.free_port()
        codes = forked.run_all([ctx.Process(target=_entry, args=(r, world, port, out, fn, args, group_timeout),
                                            daemon=True) for r in range(world)], timeout)
        results = []
        for r, code in enumerate(codes):
            path = Path(out) / f"{r}.pt"
            data = torch.load(path, weights_only=False) if code is not None and path.exists() else {}
            results.append(RankResult(code, data.get("value"), data.get("error")))
        return results


# [Note: one pool of ranks] Even forked ([Note: processes forked from a server]), a rank pays its
# first uses again (transformers, torch.export's lazy modules): seconds on a loaded 2-core
# machine, paid by every test that started its own. The tests that only need two healthy ranks
# share two processes instead, started once per pytest session. Each call still gets a process group of its own (a new
# port, destroyed after the call), the default torch seed of a fresh process and the warning
# filters it had, so nothing on the wire or in the RNG carries from one test to the next.
# A rank that raises ends its process, as a spawned rank does; a failed, timed-out or
# interrupted call kills the pool, and the next call starts a new one.
_POOL_START_S = 180.0  # the server importing torch and autopipe, on a loaded machine


class _RankPool:
    def __init__(self, world: int) -> None:
        ctx = forked.context()
        self.world = world
        self.calls = 0
        self.tasks, self.replies, self.procs = [], [], []
        for r in range(world):
            task_out, task_in = ctx.Pipe(duplex=False)
            reply_out, reply_in = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_serve, args=(r, world, task_out, reply_in), daemon=True)
            proc.start()
            task_out.close()
            reply_in.close()
            self.tasks.append(task_in)
            self.replies.append(reply_out)
            self.procs.append(proc)
        for r in range(world):  # each rank says so once its imports are done
            if not self.replies[r].poll(_POOL_START_S) or self.replies[r].recv() != "ready":
                self.close()
                raise RuntimeError(f"pool rank {r} did not start within {_POOL_START_S:.0f} s")

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> tuple[list[RankResult], bool]:
        """Results as :func:`spawn` gives them, and whether every rank is still healthy."""
        self.calls += 1
        with tempfile.TemporaryDirectory() as out:
            port = forked.free_port()
            for conn in self.tasks:
                conn.send((self.calls, port, out, fn, args))
            deadline = time.monotonic() + timeout
            waiting = dict(enumerate(self.replies))
            failed = False
            while waiting and time.monotonic() < deadline:
                ready = wait([*waiting.values(), *(self.procs[r].sentinel for r in waiting)],
                                           max(0.0, deadline - time.monotonic()))
                for r in list(waiting):
                    conn = waiting[r]
                    if conn in ready and conn.poll():
                        try:
                            if conn.recv() == self.calls:
                                del waiting[r]
                                continue
                        except EOFError:
                            pass
                    if not self.procs[r].is_alive():  # raised (or was killed): its peers may hang
                        self.procs[r].join()
                        del waiting[r]
                        failed = True
            results = []
            for r, proc in enumerate(self.procs):
                if r in waiting:  # still running at the deadline
                    results.append(RankResult(None))
                    continue
                path = Path(out) / f"{r}.pt"
                data = torch.load(path, weights_only=False) if path.exists() else {}
                code = proc.exitcode if not proc.is_alive() else 0
                results.append(RankResult(code, data.get("value"), data.get("error")))
        return results, not failed and not waiting

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in (*self.tasks, *self.replies):
            conn.close()


_pool: _RankPool | None = None


def _pool_run(fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> list[RankResult]:
    global _pool
    if _pool is None:
        _pool = _RankPool(2)
    pool, _pool = _pool, None  # taken: an interrupted call (pytest-timeout) leaves no pool behind
    healthy = False
    try:
        results, healthy = pool.run(fn, args, timeout)
    finally:
        if healthy:
            _pool = pool
        else:
            pool.close()
    return results


def _serve(rank: int, world: int, tasks: Any, replies: Any) -> None:
    """A pool rank: run each call's ``fn`` as :func:`_entry` would in a process of its own."""
    import warnings

    seed = torch.initial_seed()  # a fresh process's default seed
    replies.send("ready")
    while True:
        try:
            call, port, out, fn, args = tasks.recv()
        except EOFError:  # the parent is gone
            os._exit(0)
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        path = Path(out) / f"{rank}.pt"
        try:
            with warnings.catch_warnings():
                dist.init_process_group("gloo", rank=rank, world_size=world,
                                        init_method=f"tcp://127.0.0.1:{port}",
                                        timeout=datetime.timedelta(seconds=30))
                value = fn(rank, *args)
            torch.save({"value": value}, path)
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - every failure is reported to the parent
            torch.save({"error": traceback.format_exc()}, path)
            os._exit(1)
        replies.send(call)


def _ok(results: list[RankResult]) -> list[Any]:
    for r, res in enumerate(results):
        assert res.exitcode == 0, f"rank {r} exit {res.exitcode}:\n{res.error}"
    return [res.value for res in results]


# --- models -----------------------------------------------------------------------------------
def _mlp() -> Case:
    ex = autopipe.get_example("mlp", batch_size=8)
    return ex.model, ex.inputs, ex.target, ex.loss_fn


def _skip() -> Case:
    return Skip(8), (torch.randn(8, 8),), torch.randn(8, 8), F.mse_loss


def _multi_loss(out: dict[str, Tensor], y: Tensor) -> Tensor:
    return F.cross_entropy(out["logits"], y) + out["hidden"].pow(2).mean()


def _multi() -> Case:  # n = x.size(1), an int, crosses the cut
    return MultiIO(8), (torch.randn(8, 8), torch.randn(8, 8)), torch.randint(0, 2, (8,)), _multi_loss


def _gpt2_loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))


def _gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), (torch.randint(0, 64, (8, 8)),), torch.randint(0, 64, (8, 8)), _gpt2_loss


CASES: dict[str, Callable[[], Case]] = {"mlp": _mlp, "skip": _skip, "multi": _multi, "gpt2": _gpt2}


def _case(name: str) -> Case:
    torch.manual_seed(0)
    return CASES[name]()


def _made_up_plan(model: nn.Module, inputs: tuple[Tensor, ...]) -> dict[str, Any]:
    """``plan=`` and ``graph=`` for ``distributed_pipeline``: this rank's trace of ``model`` on
    the first micro-batch and 2 stages of equal layer counts from made-up costs (the same on
    every rank), for a test whose subject is not the plan: what ``method="uniform"`` splits
    without a plan, without rank 0 profiling the model first (0.6-1.2 s, the other rank waiting)."""
    from autopipe.assemble.setup import microbatch_inputs
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile

    graph = trace(model, microbatch_inputs(inputs, CHUNKS))
    return {"plan": partition(cost_profile(graph), stages=2, method="uniform", chunks=CHUNKS), "graph": graph}


def _reference(model: nn.Module, inputs: tuple[Tensor, ...], target: Tensor,
               loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
    """Mean over the same micro-batches, backward into ``model``."""
    xs = [x.tensor_split(CHUNKS) for x in inputs]
    ys = target.tensor_split(CHUNKS)
    loss = torch.stack([loss_fn(model(*[x[i] for x in xs]), ys[i]) for i in range(CHUNKS)]).mean()
    loss.backward()
    return loss.detach()


# --- rank workers (module level: spawned processes import them) -------------------------------
def _train_once(rank: int, case: str, schedule: str, recompute: str, method: str,
                steps: int = 1) -> dict[str, Any]:
    model, inputs, target, loss_fn = _case(case)
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule,
                                recompute=recompute, method=method, timeout=20)
    for _ in range(steps):  # accumulated: [Note: a step adds its own gradients]
        loss = pipe.step(*inputs, target=target)
    return {
        "loss": loss,
        "grads": {n: p.grad for n, p in pipe.stage_module.named_parameters()},
        "wires": [w.kind for s in pipe.wire_stages for w in s.inputs],
        "schedule": type(pipe._schedule).__name__,
    }


def _close(actual: Any, expected: Any, name: str) -> None:
    def msg(m: str) -> str:
        return f"{name}: {m}"

    assert_close(actual, expected, msg=msg)


def _assert_matches_reference(case: str, values: list[dict[str, Any]], steps: int = 1) -> nn.Module:
    """``steps`` steps of the same batch accumulated: ``steps`` times the gradients."""
    model, inputs, target, loss_fn = _case(case)
    ref = _reference(model, inputs, target, loss_fn)
    assert values[0]["loss"] is None
    assert_close(values[-1]["loss"], ref)
    covered = set()
    for v in values:
        for name, grad in v["grads"].items():
            p = model.get_parameter(name)
            _close(grad, steps * p.grad, name)
            covered.add(id(p))
    assert covered == {id(p) for p in model.parameters()}
    return model


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "schedule", "recompute", "method"),
    [
        pytest.param("mlp", "gpipe", "except_last", "auto", marks=pytest.mark.compat),
        pytest.param("mlp", "1f1b", "never", "uniform", marks=pytest.mark.compat),
        ("skip", "gpipe", "always", "uniform"),
        ("multi", "1f1b", "except_last", "uniform"),
        # two steps accumulated, the tied embedding and head on two ranks
        pytest.param("gpt2", "gpipe", "except_last", "uniform", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_match_one_process(case: str, schedule: str, recompute: str, method: str) -> None:
    steps = 2 if case == "gpt2" else 1
    values = _ok(spawn(_train_once, case, schedule, recompute, method, steps))
    _assert_matches_reference(case, values, steps)
    if schedule == "gpipe":  # [Note: receive ahead], not torch's ScheduleGPipe
        assert [v["schedule"] for v in values] == ["PrefetchGPipe"] * 2
    wires = values[1]["wires"]
    if case == "skip":  # the skip from `a` crosses the cut beside the main path
        assert wires.count("tensor") >= 2
    if case in ("multi", "gpt2"):  # python ints (sizes) cross the cut as 0-d tensors
        assert "scalar" in wires


def _train_without_prefetch(rank: int) -> dict[str, Any]:
    import executor.ranks.torch_schedules

    # as on a torch whose private schedule API drifted: executor._torch_compat's fallback
    support = executor.ranks.torch_schedules.prefetch_support
    executor.ranks.torch_schedules.prefetch_support = lambda: "forced by the test"  # type: ignore[assignment]
    try:
        return _train_once(rank, "skip", "gpipe", "always", "uniform")
    finally:  # the pool's next call gets the receive-ahead schedule back
        executor.ranks.torch_schedules.prefetch_support = support


@pytest.mark.timeout(60)
@pytest.mark.compat
def test_gpipe_on_torchs_own_schedule_matches_one_process() -> None:
    values = _ok(spawn(_train_without_prefetch))
    _assert_matches_reference("skip", values)
    assert [v["schedule"] for v in values] == ["ScheduleGPipe"] * 2


def _wires_from_rank0(rank: int, plan: dict[str, Any]) -> dict[bool, dict[str, Any]]:
    """Build ``plan`` twice, the second time with rank 0's wires refused as unpicklable: how
    often this rank ran infer_wires, and the wires it built with."""
    import autopipe.assemble.from_rank0 as built

    calls: list[int] = []
    got: list[Any] = []
    infer, of_rank0, picklable = built.infer_wires, built.wires_of_rank0, built._picklable

    def counted(*args: Any) -> Any:
        calls.append(rank)
        return infer(*args)

    def recorded(*args: Any) -> Any:
        got.append(of_rank0(*args))
        return got[-1]

    built.infer_wires, built.wires_of_rank0 = counted, recorded  # type: ignore[assignment]
    out = {}
    try:
        for refused in (False, True):
            calls.clear()
            built._picklable = (lambda _: False) if refused else picklable  # type: ignore[assignment]
            model, inputs, target, loss_fn = _case("multi")
            pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS,
                                        plan=autopipe.Plan.from_dict(plan), timeout=20)
            out[refused] = {"calls": len(calls), "wires": got[-1], "loss": pipe.step(*inputs, target=target)}
    finally:
        built.infer_wires, built.wires_of_rank0, built._picklable = infer, of_rank0, picklable  # type: ignore[assignment]
    return out


@pytest.mark.timeout(60)
def test_rank0_infers_the_wires_for_every_rank() -> None:
    """Rank 0 alone probes the stages (a symbolic run as costly as a trace); the others build
    with its wires, equal to what they would infer; wires that do not pickle: each its own."""
    from autopipe.assemble.setup import microbatch_inputs
    from autopipe.frontend.building.stages import build
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile

    model, inputs, target, loss_fn = _case("multi")
    micro = microbatch_inputs(inputs, CHUNKS)
    graph = trace(model, micro)
    plan = partition(cost_profile(graph), stages=2, method="dp", chunks=CHUNKS)
    want = infer_wires(build(model, plan, graph), micro)
    assert any(w.kind == "scalar" for w in want[1])  # an int crosses the cut
    values = _ok(spawn(_wires_from_rank0, plan.to_dict()))
    assert [v[False]["calls"] for v in values] == [1, 0]
    assert [v[True]["calls"] for v in values] == [1, 1]
    for v in values:
        assert v[False]["wires"] == want and v[True]["wires"] == want
    reference = _reference(model, inputs, target, loss_fn)
    for refused in (False, True):
        assert_close(values[1][refused]["loss"], reference)


def _other_seed_each(rank: int) -> dict[str, Any]:
    """The mlp built with this rank's own seed: the pipeline trains rank 0's weights. Buckets of
    one tensor's size at most, so the broadcast is cut into several."""
    import autopipe.assemble.from_rank0 as built

    model, inputs, target, loss_fn = _case("mlp")
    if rank:
        torch.manual_seed(100 + rank)
        for p in model.parameters():
            nn.init.normal_(p)
    bucket, built.SYNC_BUCKET_BYTES = built.SYNC_BUCKET_BYTES, 64 * 64 * 4
    try:
        pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, timeout=20, **_made_up_plan(model, inputs))
    finally:
        built.SYNC_BUCKET_BYTES = bucket
    return {"loss": pipe.step(*inputs, target=target), "state": pipe.state_dict(),
            "grads": {n: p.grad for n, p in pipe.stage_module.named_parameters()}}


@pytest.mark.timeout(60)
def test_ranks_of_other_initial_weights_train_rank0s() -> None:
    values = _ok(spawn(_other_seed_each))
    _assert_matches_reference("mlp", values)  # rank 0's weights: _case seeds 0, as there
    reference = _case("mlp")[0].state_dict()
    assert set(values[0]["state"]) | set(values[1]["state"]) == set(reference)
    for v in values:
        for key, value in v["state"].items():
            assert_close(value, reference[key], msg=key)


def _interleaved(rank: int) -> dict[str, Any]:
    model, inputs, target, loss_fn = _case("mlp")
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS, method="uniform",
                                schedule="interleaved1f1b", timeout=20)
    loss = pipe.step(*inputs, target=target)
    assert isinstance(pipe.stage_module, nn.ModuleList) and len(pipe.stage_module) == 2
    return {"loss": loss, "grads": {n: p.grad for s in pipe.stages for n, p in s.named_parameters()},
            "indices": pipe.indices}


@pytest.mark.timeout(60)
def test_interleaved_four_stages_on_two_ranks() -> None:
    values = _ok(spawn(_interleaved))
    assert [v["indices"] for v in values] == [[0, 2], [1, 3]]
    values[0]["loss"] = None  # stage 3 (the last) is on rank 1
    _assert_matches_reference("mlp", values)


def _planned(rank: int, schedule: str, recompute: bool = False, evaluate: bool = False) -> dict[str, Any]:
    model, inputs, target, loss_fn = _case("mlp")
    prof = autopipe.profile(model, inputs, chunks=CHUNKS, repeats=1, warmup=0, progress=False)
    plan = autopipe.partition(prof, stages=2, method="uniform", schedule=schedule)  # same on both ranks
    if recompute:  # [Note: recomputed layers]: every layer of both stages, each alone
        plan = autopipe.Plan.from_stages(prof, plan.stages, chunks=plan.chunks, recompute="never",
                                         schedule=schedule, recompute_layers=prof.layers)
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, plan=plan, timeout=20)
    if evaluate:  # a forward-only first run ([Note: integers across a cut]: torch 2.11's buffers)
        pipe.eval_step(*inputs, target=target)
    loss = pipe.step(*inputs, target=target)
    return {"loss": loss, "grads": {n: p.grad for n, p in pipe.stage_module.named_parameters()},
            "schedule": type(pipe._schedule).__name__, "plan": pipe.plan == plan,
            "recomputed": sum(isinstance(m, RecomputedLayer) for m in pipe.stage_module.modules())}


@pytest.mark.timeout(60)
def test_a_plan_runs_the_schedule_it_was_made_for() -> None:
    # the plan's prediction is for its schedule: without schedule=, that is the one that runs
    values = _ok(spawn(_planned, "1f1b"))
    assert [v["schedule"] for v in values] == ["Schedule1F1B"] * 2
    assert [v["plan"] for v in values] == [True, True]  # pipe.plan: what it runs, as on one process
    _assert_matches_reference("mlp", values)


@pytest.mark.compat
@pytest.mark.timeout(60)
def test_an_eval_step_before_the_first_step_leaves_its_gradients_as_one_process() -> None:
    # torch 2.11 made the receive buffers at that first, forward-only run without a gradient:
    # rank 0 got none back, in every later step (the compat job runs this on 2.11)
    _assert_matches_reference("mlp", _ok(spawn(_planned, "1f1b", False, True)))


@pytest.mark.timeout(60)
def test_layers_recomputed_alone_on_two_ranks_match_one_process() -> None:
    values = _ok(spawn(_planned, "gpipe", True))
    assert all(v["recomputed"] > 0 for v in values)
    _assert_matches_reference("mlp", values)


def _train_and_save(rank: int, case: str, out: str) -> dict[str, Any]:
    model, inputs, target, loss_fn = _case(case)
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, timeout=20, **_made_up_plan(model, inputs))
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        pipe.step(*inputs, target=target)
        opt.step()
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(pipe.state_dict(), path)
    return {"path": path, "keys": sorted(pipe.state_dict())}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_checkpoint_merge_round_trip(tmp_path: Path) -> None:
    values = _ok(spawn(_train_and_save, "gpt2", str(tmp_path)))
    assert "transformer.wte.weight" in values[0]["keys"] and "lm_head.weight" in values[1]["keys"]
    model, inputs, target, loss_fn = _case("gpt2")
    fresh, *_ = _case("gpt2")
    merged = merge_state_dicts([v["path"] for v in values], model=fresh)
    fresh.load_state_dict(merged, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        _reference(model, inputs, target, loss_fn)
        opt.step()
    for key, value in model.state_dict().items():
        _close(fresh.state_dict()[key], value, key)


# The steady steps' timeout and the watchdog's grace in _fail's ranks: short, so that a rank
# stuck past both sleeps seconds rather than the default grace's 5 s plus a timeout.
FAIL_TIMEOUT_S, FAIL_GRACE_S = 0.5, 2.0
FAIL_WATCHDOG_S = FAIL_TIMEOUT_S + FAIL_GRACE_S  # a step still running then is ended
FAIL_FIRST_STEP_S = 30  # the first step's own limit, which a later step must not get


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _stuck_until_gone(marker: Path, limit: float) -> None:
    """Stuck (no call into the pipeline) until the process whose pid ``marker`` names has ended,
    ``limit`` seconds at most: rank 1 of the "hangs" case, stuck past the timeout and the
    watchdog for as long as rank 0 needs them, not for a guess of how long that is."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if _gone(int(marker.read_text())):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)


def _fail(rank: int, how: str, marker: str) -> tuple[str, float]:
    import executor.ranks.watchdog

    executor.ranks.watchdog.GRACE_S = FAIL_GRACE_S  # read per step; this test's fresh processes only
    model, inputs, target, loss_fn = _case("mlp")
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, timeout=FAIL_TIMEOUT_S,
                                first_step_timeout=FAIL_FIRST_STEP_S, **_made_up_plan(model, inputs))
    if rank == 1 and how == "hangs":  # a first step that warms up past the timeout and watchdog,
        time.sleep(FAIL_WATCHDOG_S + 1)  # within its own limit
    pipe.step(*inputs, target=target)
    if rank == 1 and how == "dies":
        os._exit(17)  # as a crashed or OOM-killed rank would
    if rank == 1:  # alive but stuck past the timeout and the watchdog, until rank 0 is gone (its
        _stuck_until_gone(Path(marker), FAIL_WATCHDOG_S + 2)  # step failed, or its watchdog ended it)
    start = time.monotonic()
    try:
        pipe.step(*inputs, target=target)
    except PipelineFailure as err:
        ended = str(err), time.monotonic() - start
    else:
        ended = "no error", time.monotonic() - start
    if rank == 0:  # its pid, for rank 1 to wait on; written whole (a rename) or not at all
        Path(marker + ".tmp").write_text(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
    return ended


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_failed_rank_ends_the_run_with_an_error_not_a_hang(how: str, tmp_path: Path) -> None:
    """A dead or hung peer ends the step within the timeout, after a first step that took longer
    than the timeout but not its own limit ([Note: the first step's own limit])."""
    # a hang bound only: ~15 s idle, 61 s beside two busy processes and other jobs (load 9)
    survivor, failed = spawn(_fail, how, str(tmp_path / "rank0-pid"), timeout=200, fresh=True)
    assert failed.exitcode == (17 if how == "dies" else 0), failed.error
    assert survivor.exitcode is not None, f"rank 0 hung after its peer {how}"
    if survivor.exitcode == 0:  # the step raised PipelineFailure before the peer could answer
        message, seconds = survivor.value
        assert "rank 0/2: pipeline step 2" in message and "peer rank died" in message
        # ended by the later steps' limit, not by the first step's: a hung peer by the timeout
        # itself (gloo's "Application timeout"), after it (a load only lengthens a wait), and
        # either long before the first step's limit would have ended it (0.07 s dead, 0.5 s hung)
        if how == "hangs":
            assert re.search(r"time ?out|timed out", message, re.I), message
            assert seconds > 0.9 * FAIL_TIMEOUT_S  # gloo's own clock, from a receive posted in the step
        assert seconds < FAIL_FIRST_STEP_S / 3
    else:  # the watchdog ended it
        assert survivor.exitcode == 3


# --- in-process: wires, bad inputs ------------------------------------------------------------
def test_wires_round_trip_python_values() -> None:
    values = (torch.ones(2, 3), 5, 0.25, True, torch.Size([2, 3]), None, "tanh")
    wires = [Wire.of(v) for v in values]
    assert [w.kind for w in wires] == ["tensor", "scalar", "scalar", "scalar", "ints", "const", "const"]
    from executor.ranks.wire import _decode, _encode

    sent = _encode(values, wires, torch.device("cpu"))
    assert len(sent) == 5 and all(isinstance(t, Tensor) for t in sent)
    back = _decode(sent, wires)
    assert back[1:] == values[1:] and [type(v) for v in back] == [type(v) for v in values]
    with pytest.raises(DistributedError, match="constant 'tanh'.*keep it fixed"):
        _encode(values[:-1] + ("relu",), wires, torch.device("cpu"))


def test_infer_wires_and_last_stage_unflatten() -> None:
    from autopipe.frontend.building.stages import split_stages
    from autopipe.frontend.tracing.graph import trace

    model, inputs, _, _ = _case("multi")
    graph = trace(model, inputs)
    stages = split_stages(graph, [graph.layers[:1], graph.layers[1:]])
    wires = infer_wires(stages, inputs)
    assert [w.kind for w in wires[1]].count("scalar") == 1
    last = WireStage(stages[1], wires[1], wires[2], first=False, last=True, device=torch.device("cpu"))
    first = WireStage(stages[0], wires[0], wires[1], first=True, last=False, device=torch.device("cpu"))
    out = last.unflatten(last(*first(*inputs)))
    assert_close(out["logits"], model(*inputs)["logits"])
    with pytest.raises(DistributedError, match="model inputs \\[1\\] are not tensors"):
        infer_wires([nn.Identity()], (torch.ones(1), 3))


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{forked.free_port()}",
                            timeout=datetime.timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_bad_inputs_without_process_group() -> None:
    model, inputs, _, loss_fn = _case("mlp")
    with pytest.raises(BuildError, match="init_process_group"):
        distributed_pipeline(model, inputs, loss_fn=loss_fn)
    with pytest.raises(DistributedError, match="init_process_group"):
        DistributedPipeline([model], [0], 1, loss_fn=loss_fn, wires=[(), ()])


@pytest.mark.usefixtures("one_rank")
def test_bad_inputs_on_one_rank() -> None:
    model, inputs, target, loss_fn = _case("mlp")
    with pytest.raises(BuildError, match="schedule='zb' is unknown"):
        distributed_pipeline(model, inputs, loss_fn=loss_fn, schedule="zb")
    with pytest.raises(BuildError, match="chunks=16 > batch size 8: micro-batches would be empty"):
        distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=16)
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS, method="uniform")
    with pytest.raises(DistributedError, match="batch size 6 is not a multiple of chunks=4"):
        pipe.step(inputs[0][:6], target=target[:6])
    with pytest.raises(DistributedError, match="needs target="):
        pipe.step(*inputs)
    with pytest.raises(DistributedError, match="^num_items_in_batch is for the model's own loss, .*loss_fn"):
        pipe.step(*inputs, target=target, num_items_in_batch=8)
    loss = pipe.step(*inputs, target=target)  # a 1-stage pipeline is the plain model
    fresh, *_ = _case("mlp")
    assert_close(loss, _reference(fresh, inputs, target, loss_fn))


def test_merge_state_dicts_refuses_diverged_ties_and_missing_keys() -> None:
    a = {"w": torch.ones(2)}
    with pytest.raises(BuildError, match="part 1 disagrees .* 'w'"):
        merge_state_dicts([a, {"w": torch.zeros(2)}])
    with pytest.raises(BuildError, match="missing \\['bias'\\]"):
        merge_state_dicts([{"weight": torch.ones(2, 2)}], model=nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_distributed_speedup_benchmark_runs_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopipe.frontend.profiling.spawned import comm
    from benchmarks.distributed_speedup import main

    # the link's and the runtime's measurement, its two ranks forked rather than spawned
    monkeypatch.setattr(comm, "start_processes", forked.start_processes)
    table = main(["--batch", "16", "--steps", "1", "--warmup", "0", "--models", "even", "--width", "8",
                  "--comm-launches", "1", "--comm-repeats", "2", "--comm-steps", "2", "--zb-chunks", "8", "--zb-rounds", "2"])
    assert "EvenBlocks (16 x Linear(8, 8) + ReLU)" in table and "2M/(M+1) = 1.78" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "step ms" not in line]
    assert [r.split(" | ")[0] for r in rows] == [
        "| one process (1 thread)", "| autopipe, auto plan", "| autopipe, equal layer counts",
        "| torch.distributed.pipelining, hand split", *["| EvenBlocks"] * 4, "| even"]
    rules = []
    for row, name in zip(rows[4:8], ("ZB-V", "DualPipeV") * 2, strict=True):  # against 1F1B at M = 8
        zb = row.split(" | ")  # the planner's V, predicted by its simulator, under each merge rule
        assert zb[1] == "8" and zb[2] == name and row.endswith(" | 1.78 |")
        split, _, rule = zb[3].partition(" (")
        assert sum(int(n) for n in split.split("/")) == 32 and len(split.split("/")) == 4
        rules.append(rule)
        assert zb[8].endswith("x") and float(zb[8][:-1]) > 0
        for ratio in (zb[7], zb[9], zb[10]):  # vs 1F1B, 1F1B's and its speedup: the median of 2 rounds (range)
            mid, lo, hi = (float(v) for v in re.fullmatch(r"([\d.]+)x \(([\d.]+)-([\d.]+)\)", ratio).groups())
            assert 0 < lo <= mid <= hi
    assert [r.endswith(", not chosen)") for r in rules] == [False, False, True, True]
    assert {rules[0][:-1], rules[2].split(",")[0]} == {"unwaited", "adjacent"}  # ZB-V: both rules ran
    assert "a crossing" in table  # the runtime's overhead per micro-batch, measured
