"""distributed_pipeline(data_parallel=2): 2 replicas x 2 stages on 4 gloo ranks vs one process.

One spawn of 4 ranks runs every case in turn (starting 4 processes costs more than a case),
each rank tracing each model once (:func:`_traced`).
Each replica steps on its own half of the global batch; at each step the mean of the replicas'
losses must equal one process's loss over the whole batch (the mean over all D x M
micro-batches, [Note: loss of a pipeline]) and, after two SGD steps, every rank's parameters
the reference's, under DDP and FSDP, with per-stage recomputation and a tied embedding/head.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from autopipe.assemble.mesh import replicas_of
from autopipe.assemble.ranks import distributed_pipeline, merge_state_dicts
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from executor.grad_norm import local_grads
from executor.ranks.distributed import PipelineFailure
from executor.ranks.grad_scaler import PipelineGradScaler
from executor.spec import V_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import RankResult, _close, spawn
from tests.models import Skip

D, K, CHUNKS, STEPS, LR = 2, 2, 2, 2, 0.1
SMALL = 0.05  # a max_norm that clips
STEP_TIMEOUT_S = 20  # the pipelines' step timeout: a dead peer must fail a step well before it


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _case(name: str) -> tuple[nn.Module, tuple[Tensor, ...], Tensor, Any]:
    """The model and the GLOBAL batch (D replicas x their local batch of 4 rows)."""
    torch.manual_seed(0)
    if name == "skip":  # a skip connection crosses the cut
        return Skip(8), (torch.randn(8, 8),), torch.randn(8, 8), F.mse_loss
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=4)  # head tied to the embedding
    return model, (torch.randint(0, 16, (8, 4)),), torch.randint(0, 16, (8, 4)), _lm_loss


def _local(values: tuple[Tensor, ...], replica: int) -> tuple[Tensor, ...]:
    return tuple(v.tensor_split(D)[replica] for v in values)


# (model, dp mode, schedule, checkpoint per stage, data_parallel given explicitly or the plan's)
CASES = [
    ("skip", "ddp", "gpipe", ["always", "except_last"], True),
    ("skip", "fsdp", "1f1b", ["never", "always"], False),
    ("tied", "ddp", "1f1b", ["except_last", "always"], False),
    ("tied", "fsdp", "gpipe", ["always", "never"], True),
    # a stage of no parameters (not under DDP)
    ("skip", "ddp", "interleaved1f1b", ["never", "always", "never", "except_last"], False),
    # the zero-bubble schedules (executor/ranks/split_backward.py): DDP's mean all-reduced by the
    # pipeline ([Note: DDP under zero bubble]); under zbv the tied embedding and head are one
    # tensor on pp rank 0, under interleaved_zb a tie across the ranks
    ("skip", "ddp", "zbv", ["never", "always", "never", "except_last"], True),
    ("skip", "fsdp", "zbv", ["never", "except_last", "always", "never"], False),
    # the GPT's 4-stage cuts carry its sequence length, a Python int ([Note: integers across a
    # cut] in executor/_torch_compat/stages.py)
    ("tied", "ddp", "zbv", ["except_last", "never", "always", "never"], False),
    ("tied", "fsdp", "interleaved_zb", ["always", "never", "never", "except_last"], False),
]


Traces = dict[str, tuple[nn.Module, Any]]


def _traced(traces: Traces, case: str, x: tuple[Tensor, ...]) -> tuple[nn.Module, Any]:
    """``_case(case)``'s model and its trace on the first micro-batch of ``x``, for ``graph=``:
    each case's model is traced once per ``traces`` (one rank's run, or the parent's plans; the
    local batches of a model have one shape), and every call gets a deep copy of that model and
    its graph together (the copy's graph holds the copy's tensors; the stored model, seeded as
    ``_case`` seeds it, never builds a pipeline), nothing shared with another call's."""
    if case not in traces:
        model = _case(case)[0]
        traces[case] = model, trace(model, microbatch_inputs(x, CHUNKS))
    with warnings.catch_warnings():  # torch's pytree specs warn as they are copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(traces[case])


def _plan(case: str, dp_mode: str, modes: list[str], traces: Traces) -> Plan:
    _, inputs, _, _ = _case(case)
    _, graph = _traced(traces, case, _local(inputs, 0))
    plan = partition(cost_profile(graph), stages=len(modes), method="uniform", chunks=CHUNKS)
    return dataclasses.replace(plan, recompute=modes, data_parallel=D, dp_mode=dp_mode)


def _train(rank: int, out: str, plans: list[dict[str, Any]], refused: dict[str, Any]) -> tuple[str, float] | None:
    """Every case, its results saved; then rank 3 dies and the others' next step fails."""
    results = []
    traces: Traces = {}
    for n, (case, dp_mode, schedule, _, explicit) in enumerate(CASES):
        _, inputs, target, loss_fn = _case(case)
        replica = rank // K  # [Note: replicas on a mesh]: rank = dp x K + pp
        x, (y,) = _local(inputs, replica), _local((target,), replica)
        given: dict[str, Any] = {"data_parallel": D, "dp_mode": dp_mode} if explicit else {}
        model, graph = _traced(traces, case, x)
        pipe = distributed_pipeline(model, x, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule,
                                    plan=Plan.from_dict(plans[n]), timeout=STEP_TIMEOUT_S, graph=graph, **given)
        opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            losses.append(pipe.step(*x, target=y))
            opt.step()
        state = pipe.state_dict()  # every rank: a collective under FSDP
        path = None
        if pipe.dp_rank == 0:  # one part per stage
            path = os.path.join(out, f"{n}-stage{pipe.pp_rank}.pt")
            torch.save(state, path)
        results.append({"where": (pipe.dp_rank, pipe.dp_size, pipe.pp_rank, pipe.pp_size), "last": pipe.is_last,
                        "engine": type(pipe._sized.modules[0]).__name__,  # stage 0 or 1's
                        "losses": losses, "state": {k: v.clone() for k, v in state.items()},
                        "path": path, **_overflow_then_clip(rank, pipe, opt, x, y)})
    _, inputs, target, loss_fn = _case("tied")  # FSDP cannot shard the V's one tied tensor twice
    model, graph = _traced(traces, "tied", _local(inputs, rank // K))
    try:
        distributed_pipeline(model, _local(inputs, rank // K), loss_fn=loss_fn, chunks=CHUNKS, schedule="zbv",
                             plan=Plan.from_dict(refused), timeout=STEP_TIMEOUT_S, graph=graph)
    except BuildError as err:
        results.append({"refused": str(err)})
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))  # whatever ends this process
    return _die(rank, pipe, x, y)


def _overflow_then_clip(rank: int, pipe: Any, opt: torch.optim.Optimizer, x: tuple[Tensor, ...],
                        y: Tensor) -> dict[str, Any]:
    """An fp16 step whose gradient overflows on rank 2 alone (after DDP / FSDP reduced it, so
    only the scaler's reduction tells the others), then a clean step clipped."""
    scaler = PipelineGradScaler(pipe, init_scale=2.0**8)
    opt.zero_grad()
    pipe.step(*x, target=y, scaler=scaler)
    if rank == 2:  # replica 1's first stage: its pp peer 3 and its dp peer 0 have finite grads
        grad = next(g for g in local_grads(p.grad for s in pipe.stages for p in s.parameters())[
            1 if pipe.dp_mode == "fsdp" else 0] if g.numel())
        grad.view(-1)[-1] = math.inf  # FSDP: this rank's own shard
    scaler.unscale_(opt)
    def mine() -> list[Tensor]:  # this rank's values (an FSDP shard: no collective to compare)
        return [p.to_local() if isinstance(p, DTensor) else p for p in pipe.stage_module.parameters()]

    before = [p.detach().clone() for p in mine()]
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(b, p) for b, p in zip(before, mine(), strict=True))
    opt.zero_grad()
    pipe.step(*x, target=y)
    inf = pipe.clip_grad_norm_(1e9, math.inf)
    two = pipe.clip_grad_norm_(SMALL)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for s in pipe.stages for n, p in s.named_parameters()}
    return {"skipped": skipped, "scale": scaler.get_scale(), "inf": inf, "two": two, "grads": grads}


def _die(rank: int, pipe: Any, x: tuple[Tensor, ...], y: Tensor) -> tuple[str, float] | None:
    """Rank 3 dies between steps; the others' next step must fail, not hang."""
    if rank == 3:
        os._exit(17)  # replica 1's last stage: its pp peer (2) and its dp peer (1) lose it
    start = time.monotonic()
    try:
        pipe.step(*x, target=y)
    except PipelineFailure as err:
        return str(err), time.monotonic() - start
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[RankResult, Any]]:
    """One 4-rank run for the whole module: each rank's end, and its cases' results."""
    out = tmp_path_factory.mktemp("replicas")
    traces: Traces = {}  # each model traced once here too
    plans = [_plan(case, dp_mode, modes, traces).to_dict() for case, dp_mode, _, modes, _ in CASES]  # once, not per rank
    refused = _plan("tied", "fsdp", ["never"] * 4, traces).to_dict()
    ends = spawn(_train, str(out), plans, refused, world=D * K, timeout=140)
    saved = [out / f"rank{r}.pt" for r in range(D * K)]
    return [(end, torch.load(f, weights_only=False) if f.exists() else None) for end, f in zip(ends, saved, strict=True)]


def _reference(case: str) -> tuple[nn.Module, list[Tensor]]:
    """One process: the global batch as D x CHUNKS micro-batches, two SGD steps."""
    model, inputs, target, loss_fn = _case(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = [x.tensor_split(D * CHUNKS) for x in inputs], target.tensor_split(D * CHUNKS)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.stack([loss_fn(model(*[x[i] for x in xs]), ys[i]) for i in range(D * CHUNKS)]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, losses


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.compat
def test_two_replicas_of_two_stages_match_one_process(ranks: list[tuple[RankResult, Any]]) -> None:
    for r, (end, cases) in enumerate(ranks):
        assert cases is not None, f"rank {r} exit {end.exitcode}:\n{end.error}"
    parts = [cases for _, cases in ranks]
    assert [r[0]["where"] for r in parts] == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    for n, (case, dp_mode, schedule, *_) in enumerate(CASES):
        model, ref_losses = _reference(case)
        what = f"{case}/{dp_mode}/{schedule}"
        engine = ("DistributedDataParallel" if schedule not in ZERO_BUBBLE_SCHEDULES else "WireStage") \
            if dp_mode == "ddp" else "FSDPWireStage"  # FSDP2's class; [Note: DDP under zero bubble]
        assert engine in {r[n]["engine"] for r in parts}
        last = [r for r, values in enumerate(parts) if values[n]["last"]]
        assert last == ([0, 2] if schedule in V_SCHEDULES else [1, 3]), what  # each replica's last stage
        for step in range(STEPS):  # has the loss
            assert all(parts[r][n]["losses"][step] is None for r in range(D * K) if r not in last)
            mean = (parts[last[0]][n]["losses"][step] + parts[last[1]][n]["losses"][step]) / 2
            _close(mean, ref_losses[step], f"{what} step {step}")
        expected = model.state_dict()
        for rank, values in enumerate(parts):  # every replica's copy, tied copies included
            for key, value in values[n]["state"].items():
                _close(value, expected[key], f"{what} rank {rank} {key}")
        fresh, *_ = _case(case)
        merged = merge_state_dicts([parts[0][n]["path"], parts[1][n]["path"]], model=fresh)
        fresh.load_state_dict(merged, strict=True)  # a plain model: any number of replicas
        for key, value in expected.items():
            _close(fresh.state_dict()[key], value, f"{what} merged {key}")
    for r, values in enumerate(parts):  # every rank, before any collective: one line
        assert values[-1]["refused"].startswith(
            "dp_mode='fsdp' shards each stage on its own, but stages 0 and 3 on this rank share the "
            "parameter 'tok.weight' (a tie; schedule='zbv' runs both here): use dp_mode='ddp'"), r


@pytest.mark.timeout(150)
def test_clipping_and_an_overflow_on_one_rank_agree_over_every_replica(
        ranks: list[tuple[RankResult, Any]]) -> None:
    parts = [cases for _, cases in ranks]
    assert all(p is not None for p in parts)
    for n, (case, dp_mode, schedule, *_) in enumerate(CASES):
        what = f"{case}/{dp_mode}/{schedule}"
        for rank, values in enumerate(parts):  # rank 2's overflow skipped every rank's step
            assert values[n]["skipped"], f"{what}: rank {rank} stepped"
            assert values[n]["scale"] == 2.0**7, f"{what}: rank {rank}"  # backed off everywhere
        model, _ = _reference(case)  # the state after STEPS: the fp16 step was skipped
        model.zero_grad()
        _, inputs, target, loss_fn = _case(case)
        xs, ys = [x.tensor_split(D * CHUNKS) for x in inputs], target.tensor_split(D * CHUNKS)
        torch.stack([loss_fn(model(*[x[i] for x in xs]), ys[i]) for i in range(D * CHUNKS)]).mean().backward()
        inf = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, math.inf)
        two = torch.nn.utils.clip_grad_norm_(model.parameters(), SMALL)
        assert two > 10 * SMALL, what  # the clip does scale
        for rank, values in enumerate(parts):  # each replica, each stage, each tied copy
            _close(values[n]["inf"], inf, f"{what} rank {rank} inf norm")
            _close(values[n]["two"], two, f"{what} rank {rank} 2-norm")
            for key, grad in values[n]["grads"].items():
                _close(grad, model.get_parameter(key).grad, f"{what} rank {rank} {key}")


def test_replica_counts_are_checked_in_one_line() -> None:
    model, inputs, _, _ = _case("skip")
    graph = trace(model, microbatch_inputs(inputs, CHUNKS))
    plan = partition(cost_profile(graph), stages=K, method="uniform", chunks=CHUNKS)
    assert replicas_of(None, None, None, 4) == (1, "ddp")  # every existing call: one pipeline
    assert replicas_of(dataclasses.replace(plan, data_parallel=2, dp_mode="fsdp"), None, None, 4) == (2, "fsdp")
    assert replicas_of(plan, 1, "fsdp", 4) == (1, "fsdp")
    cases = [
        ((None, 3, None, 4), r"^4 ranks do not split into data_parallel=3 replicas; start a multiple of 3"),
        ((plan, 2, None, 4), r"^the plan was made for data_parallel=1 but data_parallel=2 was given; "
                             r"leave it out .* `autopipe partition --data-parallel 2`"),
        ((None, 0, None, 4), r"^data_parallel=0 is not a number of replicas"),
        ((None, "auto", None, 4), r"^data_parallel='auto' picks D for one global batch.* pass plan="),
        ((None, 2, "zero", 4), r"^dp_mode='zero' is unknown; use one of \['ddp', 'fsdp'\]"),
        ((dataclasses.replace(plan, data_parallel=2), 2, "fsdp", 4),
         r"^the plan was made for dp_mode='ddp' but dp_mode='fsdp' was given"),
    ]
    for args, pattern in cases:
        with pytest.raises(BuildError, match=pattern) as err:
            replicas_of(*args)
        assert "\n" not in str(err.value)


@pytest.mark.timeout(150)
def test_a_dead_rank_ends_every_replica_with_an_error(ranks: list[tuple[RankResult, Any]]) -> None:
    results = [end for end, _ in ranks]
    assert results[3].exitcode == 17
    for rank in range(3):  # its pp peer 2, its dp peer 1, and rank 0 when they go
        res = results[rank]
        assert res.exitcode is not None, f"rank {rank} hung after rank 3 died"
        assert res.exitcode in (0, 3), f"rank {rank}: {res.error}"  # 3: the watchdog's exit
        if res.exitcode == 0:
            assert res.value, f"rank {rank} finished a step without rank 3"
            message, seconds = res.value
            row, column = [rank - rank % K + p for p in range(K)], [rank % K + K * d for d in range(D)]
            # STEPS, the fp16 and the clipped step (_overflow_then_clip), then this one
            assert message.startswith(f"rank {rank}/4 (pipeline rank {rank % K}/2 of pp group {row}, "
                                      f"replica {rank // K}/2 of dp group {column}): pipeline step {STEPS + 3}"), message
            # failed by the dead peer's lost connection, not by the step's timeout: gloo's cause
            # is no timeout, and it came before the timeout could have fired (it takes ~0.05 s)
            assert "timed out" not in message.lower() and "timeout" not in message.lower(), message
            assert seconds < STEP_TIMEOUT_S
