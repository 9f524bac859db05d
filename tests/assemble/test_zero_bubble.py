"""The zero-bubble schedules (interleaved_zb, zbv, dualpipev) on 2 gloo ranks vs one process.

Each backward is split into its input and weight gradients ([Note: split backward on ranks] in
executor/ranks/split_backward.py). One call on the shared pool of two ranks ([Note: one pool of
ranks]) runs every case: a skip connection and a GPT whose head is tied to its embedding (under
the V schedules both sit on rank 0, one tensor in two stages), recomputation per stage and per
layer, eval_step, another sequence length, the model's own loss, bf16, a GradScaler, clipping,
and a checkpoint saved under zbv and loaded under 1F1B. Every gradient is compared with the
plain model's on the same micro-batches (see [Note: loss of a pipeline]). PP x DP under these
schedules is in tests/assemble/test_replicas.py's one 4-rank run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.plan import Plan
from autopipe.core.schedules import rank_order
from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.building.stages import RecomputedLayer
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from executor.checkpoint import load_checkpoint
from executor.ranks.distributed import DistributedError, DistributedPipeline
from executor.ranks.grad_scaler import PipelineGradScaler
from executor.ranks.split_backward import WeightGrads, split_call
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import _ok, one_rank, spawn  # noqa: F401 - a fixture
from tests.models import Skip

CHUNKS, V, SMALL = 4, 16, 0.05


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tied(length: int = 6) -> tuple[nn.Module, tuple[Tensor, ...], Tensor, Any]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=V, dim=8, heads=2, layers=2, max_len=12)  # head tied to the embedding
    return model, (torch.randint(0, V, (8, length)),), torch.randint(0, V, (8, length)), _lm_loss


def _ids(length: int, seed: int) -> Tensor:
    return torch.randint(0, V, (8, length), generator=torch.Generator().manual_seed(seed))


def _skip() -> tuple[nn.Module, tuple[Tensor, ...], Tensor, Any]:
    torch.manual_seed(0)
    return Skip(8), (torch.randn(8, 8),), torch.randn(8, 8), F.mse_loss


class OwnLoss(nn.Module):
    """A tied GPT that computes its own mean cross-entropy over the labels that are not -100."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT(vocab=V, dim=8, heads=2, layers=2, max_len=12)

    def forward(self, input_ids: Tensor, labels: Tensor) -> dict[str, Tensor]:
        logits = self.gpt(input_ids)
        return {"loss": F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)), "logits": logits}


def _own() -> tuple[nn.Module, dict[str, Tensor]]:
    torch.manual_seed(0)
    ids = torch.randint(0, V, (8, 6))
    labels = ids.clone()
    labels[:2, 1:] = -100  # the first micro-batch counts far fewer items than the others
    return OwnLoss(), {"input_ids": ids, "labels": labels}


MODELS = {"tied": _tied, "skip": _skip}


@functools.cache
def _profile(name: str) -> Any:
    model, inputs, _, _ = MODELS[name]()
    return cost_profile(trace(model, microbatch_inputs(inputs, CHUNKS)))


def _plan(name: str, stages: int = 4, layers: bool = False) -> Plan:
    """Made-up costs (nothing measured: the same plan on both ranks), planned for 1F1B's layout;
    the zero-bubble schedule is ``distributed_pipeline``'s ``schedule=``."""
    prof = _profile(name)
    plan = partition(prof, stages=stages, method="uniform", chunks=CHUNKS)
    if layers:  # [Note: recomputed layers]: each layer of every stage recomputed alone
        plan = Plan.from_stages(prof, plan.stages, chunks=CHUNKS, recompute="never",
                                recompute_layers=prof.layers)
    return plan


def _grads(pipe: Any) -> dict[str, Tensor]:
    return {n: p.grad.clone() for s in pipe.stages for n, p in s.named_parameters() if p.grad is not None}


# (model, schedule, checkpoint per stage or for all, each layer recomputed alone, the plan's
# merge rule: [Note: adjacent I and W] in executor/spec.py). The skip
# connection's run on torch 2.11 and 2.15 too (`-m compat`); the GPT's run on torch 2.13 only, as it
# also feeds the pipeline another sequence length, which torch 2.11's stages refuse.
Case = tuple[str, str, Any, bool, str]
SKIP_CASES: list[Case] = [
    ("skip", "zbv", "never", False, "unwaited"),
    ("skip", "zbv", "except_last", False, "adjacent"),  # every adjacent I and W as one backward
    ("skip", "dualpipev", "always", False, "unwaited"),
    ("skip", "interleaved_zb", ["except_last", "never", "always", "never"], False, "unwaited"),
]
TIED_CASES: list[Case] = [
    ("tied", "zbv", ["always", "never", "except_last", "never"], False, "unwaited"),
    ("tied", "interleaved_zb", "except_last", False, "unwaited"),  # the tie across ranks: stages 0 | 3
    ("tied", "zbv", "never", True, "unwaited"),  # torch's reentrant checkpoint in the stages
]


def _plans(cases: list[Case], extra: bool) -> dict[str, dict[str, Any]]:
    """Every plan the ranks run, made once here (as JSON: the same on both ranks); a case of
    another merge rule than the default has its plan made for its schedule (the rule is the
    plan's for its own schedule)."""
    plans = {f"case{n}": dataclasses.replace(_plan(name, layers=layers), recompute=checkpoint,
                                             **({"schedule": schedule, "merge_backward": merge}
                                                if merge != "unwaited" else {}))
             for n, (name, schedule, checkpoint, layers, merge) in enumerate(cases)}
    if extra:
        plans |= {"tied2": _plan("tied", stages=2), "own": _own_plan()}
    return {k: v.to_dict() for k, v in plans.items()}


def _zero_bubble(rank: int, out: str, cases: list[Case], dicts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import executor.ranks.split_backward as split

    weight_passes = [0]
    part = split._weight_part

    def counted(*args: Any) -> None:
        weight_passes[0] += 1
        part(*args)

    split._weight_part = counted  # type: ignore[assignment]
    try:
        plans = {k: Plan.from_dict(v) for k, v in dicts.items()}
        values: dict[str, Any] = {}
        for n, (name, schedule, _, _, _) in enumerate(cases):
            model, inputs, target, loss_fn = MODELS[name]()
            weight_passes[0] = 0
            pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, plan=plans[f"case{n}"], schedule=schedule,
                                        timeout=30)
            loss = pipe.step(*inputs, target=target)
            values[f"case{n}"] = {
                "loss": loss, "grads": _grads(pipe), "indices": pipe.indices, "ties": len(pipe._ties),
                "weight_passes": weight_passes[0], "schedule": type(pipe._schedule).__name__,
                "eval": pipe.eval_step(*inputs, target=target),
                "recomputed": sum(isinstance(m, RecomputedLayer) for s in pipe.stages for m in s.modules())}
            if n == 0 and "own" in plans:
                _tied_steps(pipe, values, out)
        if "own" in plans:
            _more(values, plans)
            _planless(values)
        return values
    finally:  # the pool's next call gets torch's own back
        split._weight_part = part  # type: ignore[assignment]


def _planless(values: dict[str, Any]) -> None:
    """Without a plan, rank 0 partitions for the schedule asked for, laid out as it runs."""
    import autopipe.solvers.partitioner as partitioner

    asked: list[dict[str, Any]] = []
    real = partitioner.partition

    def recorded(*args: Any, **kwargs: Any) -> Plan:
        plan = real(*args, **kwargs)
        asked.append({"schedule": plan.schedule, "devices": [d.name for d in plan.devices]})
        return plan

    partitioner.partition = recorded  # type: ignore[assignment]
    try:
        model, inputs, target, loss_fn = MODELS["skip"]()
        pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, example_target=target, schedule="zbv",
                                    chunks=CHUNKS, timeout=30)
        loss = pipe.step(*inputs, target=target)
    finally:
        partitioner.partition = real  # type: ignore[assignment]
    values["planless"] = {"asked": asked, "loss": loss, "grads": _grads(pipe), "indices": pipe.indices}


def _more(values: dict[str, Any], plans: dict[str, Plan]) -> None:
    """The model's own loss, bf16, and the zbv checkpoint loaded under 1F1B."""
    model, batch = _own()  # the model's own loss, weighted by each micro-batch's counted labels
    pipe = distributed_pipeline(model, example_kwargs=batch, chunks=CHUNKS, plan=plans["own"],
                                schedule="zbv", timeout=30)
    values["own"] = {"loss": pipe.step(**batch), "grads": _grads(pipe)}
    model, (x,), y, loss_fn = _tied()
    with warnings.catch_warnings():  # a plan of fp32's (made-up) costs
        warnings.simplefilter("ignore")
        pipe = distributed_pipeline(model, (x,), loss_fn=loss_fn, plan=plans["case0"], schedule="zbv",
                                    precision="bf16", timeout=30)
    values["bf16"] = {"loss": pipe.step(x, target=y), "grads": _grads(pipe)}
    model, *_ = _tied()  # the zbv checkpoint loaded under 1F1B, which steps once more
    pipe = distributed_pipeline(model, (x,), loss_fn=loss_fn, plan=plans["tied2"], schedule="1f1b", timeout=30)
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=0.01)
    pipe.load_checkpoint(values["path"], opt)
    opt.zero_grad()
    pipe.step(x, target=y)
    opt.step()
    values["resumed"] = {k: v.clone() for k, v in pipe.state_dict().items()}


def _tied_steps(pipe: Any, values: dict[str, Any], out: str) -> None:
    """On case 1's pipeline (the tied GPT under zbv): eval_step, a step at another length, a
    scaled step unscaled and clipped, then an AdamW step, saved."""
    _, (x,), y, _ = _tied()
    values["eval"] = {"out": pipe.eval_step(x), "loss": pipe.eval_step(x, target=y)}
    for p in pipe.stage_module.parameters():
        p.grad = None
    pipe.step(_ids(10, 1), target=_ids(10, 2))  # another sequence length: its own schedule
    values["longer"] = _grads(pipe)
    for p in pipe.stage_module.parameters():
        p.grad = None
    scaler = PipelineGradScaler(pipe, init_scale=2.0**8)
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=0.1)
    loss = pipe.step(x, target=y, scaler=scaler)
    scaler.unscale_(opt)
    values["scaled"] = {"loss": loss, "grads": _grads(pipe), "inf": pipe.clip_grad_norm_(1e9, math.inf),
                        "two": pipe.clip_grad_norm_(SMALL), "clipped": _grads(pipe)}
    opt = torch.optim.AdamW(pipe.stage_module.parameters(), lr=0.01)
    opt.zero_grad()
    pipe.step(x, target=y)
    opt.step()
    values["path"] = os.path.join(out, "ckpt")
    pipe.save_checkpoint(values["path"], opt)


def _own_plan() -> Plan:
    model, batch = _own()
    graph = trace(model, (), example_kwargs={k: v.tensor_split(CHUNKS)[0] for k, v in batch.items()})
    return partition(cost_profile(graph), stages=4, method="uniform", chunks=CHUNKS)


def _reference(model: nn.Module, inputs: tuple[Tensor, ...], target: Tensor, loss_fn: Any,
               backward: bool = True) -> Tensor:
    xs, ys = [x.tensor_split(CHUNKS) for x in inputs], target.tensor_split(CHUNKS)
    loss = torch.stack([loss_fn(model(*[x[i] for x in xs]), ys[i]) for i in range(CHUNKS)]).mean()
    if backward:
        loss.backward()
    return loss.detach()


def _merged(values: list[dict[str, Any]], key: str) -> dict[str, Tensor]:
    return {n: g for v in values for n, g in v[key].items()}


def _match(grads: dict[str, Tensor], model: nn.Module, what: str, **tol: float) -> None:
    covered = set()
    for name, grad in grads.items():
        p = model.get_parameter(name)
        assert_close(grad, p.grad, msg=lambda m, name=name: f"{what} {name}: {m}", **tol)
        covered.add(id(p))
    assert covered == {id(p) for p in model.parameters()}, what


def _check_cases(values: list[dict[str, Any]], cases: list[Case]) -> None:
    for n, (name, schedule, _, layers, merge) in enumerate(cases):
        what = f"{name}/{schedule}{'/layers' if layers else ''}/{merge}"
        runs = [v[f"case{n}"] for v in values]
        model, inputs, target, loss_fn = MODELS[name]()
        ref = _reference(model, inputs, target, loss_fn)
        v_layout = schedule in ("zbv", "dualpipev")
        assert [r["indices"] for r in runs] == ([[0, 3], [1, 2]] if v_layout else [[0, 2], [1, 3]]), what
        last, other = (runs[0], runs[1]) if v_layout else (runs[1], runs[0])  # the V ends on rank 0
        assert_close(last["loss"], ref, msg=what)
        assert other["loss"] is None and other["eval"] is None, what
        _match(_merged(runs, "grads"), model, what)
        with torch.no_grad():  # forward only: the same loss (no dropout here)
            assert_close(last["eval"], _reference(copy.deepcopy(model).eval(), inputs, target, loss_fn, False))
        assert runs[0]["schedule"] == {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
                                       "interleaved_zb": "ScheduleInterleavedZeroBubble"}[schedule], what
        if name == "tied":  # one tensor in two stages of rank 0 under the V: no tie group
            assert [r["ties"] for r in runs] == ([0, 0] if v_layout else [1, 1]), what
        if layers:  # a reentrant recompute: the whole backward at the I, no weight pass
            assert all(r["recomputed"] > 0 and r["weight_passes"] == 0 for r in runs), what
        else:  # the weights' half ran apart, at each W that does not follow its I at once; the
            # adjacent halves ran as one backward ([Note: adjacent I and W] in executor/spec.py)
            split = [sum(kind == "I" and s != 0 for s, kind, _ in rank_order(schedule, r, 2, CHUNKS, 2, merge))
                     for r in range(2)]
            assert [r["weight_passes"] for r in runs] == split and sum(split) > 0, what
            if merge != "unwaited":  # fewer halves apart than under the default rule
                assert sum(split) < sum(kind == "I" and s != 0 for r in range(2)
                                        for s, kind, _ in rank_order(schedule, r, 2, CHUNKS, 2)), what


@pytest.mark.timeout(90)
@pytest.mark.compat
def test_zero_bubble_schedules_of_a_skip_connection_on_two_ranks_equal_one_process(tmp_path: Path) -> None:
    """zbv, dualpipev and interleaved_zb, recomputing per stage, and eval_step."""
    values = _ok(spawn(_zero_bubble, str(tmp_path), SKIP_CASES, _plans(SKIP_CASES, False), timeout=80))
    _check_cases(values, SKIP_CASES)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_zero_bubble_schedules_of_a_tied_gpt_on_two_ranks_equal_one_process(tmp_path: Path) -> None:
    values = _ok(spawn(_zero_bubble, str(tmp_path), TIED_CASES, _plans(TIED_CASES, True), timeout=110))
    _check_cases(values, TIED_CASES)
    # no plan: rank 0 planned for ZB-V itself, its 4 stages in the V, and the gradients match
    runs = [v["planless"] for v in values]
    assert runs[0]["asked"] == [{"schedule": "zbv", "devices": ["rank:0", "rank:1", "rank:1", "rank:0"]}]
    assert runs[1]["asked"] == [] and [r["indices"] for r in runs] == [[0, 3], [1, 2]]
    model, inputs, target, loss_fn = MODELS["skip"]()
    assert_close(runs[0]["loss"], _reference(model, inputs, target, loss_fn))
    _match(_merged(runs, "grads"), model, "skip/zbv without a plan")
    _check_tied_steps(values)


def _check_tied_steps(values: list[dict[str, Any]]) -> None:
    """eval_step, a step at another length, a scaled step unscaled, and clipping (zbv)."""
    model, (x,), y, loss_fn = _tied()
    with torch.no_grad():  # on rank 0, which runs the V's last stage
        assert_close(values[0]["eval"]["out"], model.eval()(x))
        assert_close(values[0]["eval"]["loss"], torch.stack(
            [loss_fn(model(a), b) for a, b in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True)]).mean())
    assert values[1]["eval"]["out"] is None
    model.train()
    _reference(model, (_ids(10, 1),), _ids(10, 2), loss_fn)
    _match(_merged(values, "longer"), model, "length 10")
    model.zero_grad(set_to_none=True)
    ref = _reference(model, (x,), y, loss_fn)
    scaled = [v["scaled"] for v in values]
    assert_close(scaled[0]["loss"], ref)
    _match(_merged(scaled, "grads"), model, "scaled then unscaled")
    inf = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, math.inf)
    two = torch.nn.utils.clip_grad_norm_(model.parameters(), SMALL)
    assert two > 10 * SMALL  # the clip does scale
    for rank, s in enumerate(scaled):
        assert_close(s["inf"], inf, msg=f"rank {rank} inf norm")
        assert_close(s["two"], two, msg=f"rank {rank} 2-norm")
    _match(_merged(scaled, "clipped"), model, "clipped")
    _check_own_loss_bf16_and_resume(values)


def _check_own_loss_bf16_and_resume(values: list[dict[str, Any]]) -> None:
    model, batch = _own()
    expected = model(**batch)["loss"]  # the whole batch's mean over its counted labels
    expected.backward()
    assert_close(values[0]["own"]["loss"], expected.detach())
    _match(_merged([v["own"] for v in values], "grads"), model, "own loss")
    from tests.assemble.test_precision import _close

    model, (x,), y, loss_fn = _tied()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(model, (x,), y, loss_fn)
    _close(values[0]["bf16"]["loss"], ref, "bf16 loss")
    for name, grad in _merged([v["bf16"] for v in values], "grads").items():
        assert grad.dtype == torch.float32
        _close(grad, model.get_parameter(name).grad, f"bf16 {name}")
    model, *_ = _tied()  # two AdamW steps of the plain model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        _reference(model, (x,), y, loss_fn)
        opt.step()
    for rank, v in enumerate(values):
        for key, value in v["resumed"].items():
            assert_close(value, model.state_dict()[key], msg=f"rank {rank} {key}")
    plain, *_ = _tied()  # the zbv checkpoint loads into the plain model as well
    load_checkpoint(values[0]["path"], plain)
    once, *_ = _tied()
    opt = torch.optim.AdamW(once.parameters(), lr=0.01)
    _reference(once, (x,), y, loss_fn)
    opt.step()
    for key, value in once.state_dict().items():
        assert_close(plain.state_dict()[key], value, msg=key)


@pytest.mark.compat
def test_a_split_backward_gives_the_input_gradients_first_and_the_weights_at_the_w() -> None:
    """In one process: a stage that uses a weight twice, a multi-output op and a pass-through
    value; the input gradients come before any weight's, and after the W both are torch's. A
    stage with an output of its weights alone (neither half reaches it) backpropagates whole."""

    class Stage(nn.Module):
        def __init__(self, alone: bool) -> None:
            super().__init__()
            self.a, self.b, self.ln = nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4)
            self.alone = alone

        def forward(self, x: Tensor, h: Tensor) -> tuple[Tensor, ...]:
            q, k = self.b(self.a(x)).chunk(2, dim=-1)
            z = torch.cat([q * k, k], -1)
            out = (self.ln(z + self.a(z)), h + 1.0, (x.sum(-1) > 0).long())
            return (*out, self.ln.weight * 2.0) if self.alone else out

    torch.manual_seed(0)
    x, h = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    grads = [torch.randn(3, 4), torch.randn(3, 4), None, torch.randn(4)]
    for alone, first in ((False, False), (False, True), (True, False)):  # first: no input needs a gradient
        torch.manual_seed(0)
        stage = Stage(alone)
        reference = copy.deepcopy(stage)
        xr, hr = x.detach().requires_grad_(), h.detach().requires_grad_()
        ys = reference(xr, hr)
        torch.autograd.backward([ys[0], ys[1], *ys[3:]], [g for g in grads[:len(ys)] if g is not None])
        weights = WeightGrads(stage.parameters)
        xs, hs = x.detach().requires_grad_(not first), h.detach().requires_grad_(not first)
        out = split_call(lambda a, b, stage=stage: stage(a, b), [xs, hs], torch.device("cpu"), weights)
        assert not out[2].requires_grad  # integers cross without a gradient
        torch.autograd.backward([out[0], out[1], *out[3:]], [g for g in grads[:len(out)] if g is not None])
        assert all((p.grad is None) is not alone for p in stage.parameters())  # the I (torch's backward)
        if not first:
            assert_close(xs.grad, xr.grad)
            assert_close(hs.grad, hr.grad)
        weights.builder()()  # the W
        for (name, p), q in zip(stage.named_parameters(), reference.parameters(), strict=True):
            assert_close(p.grad, q.grad, msg=name)


@pytest.mark.usefixtures("one_rank")
def test_bad_zero_bubble_combinations_say_so_in_one_line() -> None:
    model, inputs, _, loss_fn = _skip()
    cases = [
        ({"schedule": "zbv", "stages_per_rank": 3},
         r"^schedule='zbv' runs exactly 2 stages per rank \(rank r: stages r and 2W-1-r\): 1 ranks need 2 "
         r"stages, not 3; use 1 ranks for 2 stages$"),
        ({"schedule": "dualpipev", "chunks": 1},
         r"^schedule='dualpipev' needs chunks >= stages \(2\), got chunks=1; use chunks=2 or more, or "
         r"schedule='zbv'$"),
        ({"schedule": "gpipe", "stages_per_rank": 2},
         r"^schedule='gpipe' runs one stage per rank: 2 stages need 2 ranks, not 1"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(BuildError, match=pattern) as err:
            distributed_pipeline(model, inputs, loss_fn=loss_fn, method="uniform", **kwargs)
        assert "\n" not in str(err.value)
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, plan=_plan("skip", stages=2), schedule="zbv")
    assert pipe.indices == [0, 1]  # one rank: both halves of the V
    with pytest.raises(DistributedError, match=r"^merge_backward='all': choose one of \['unwaited', 'adjacent'\]$"):
        DistributedPipeline(pipe.stages, [0, 1], 2, loss_fn=loss_fn, wires=pipe.wires, schedule="zbv",
                            merge_backward="all")
