"""clip_grad_norm_ and fp16 loss scaling on 2 gloo ranks (the shared pool) vs one process.

The clipped norm and gradients of a GPT whose head is tied to its embedding (first and last
stage on different ranks) equal torch's on the plain model; an inf injected into one rank's
gradient skips the optimizer step on both ranks and backs the scale off as torch's
GradScaler does ([Note: loss scaling on ranks] in executor/ranks/grad_scaler.py).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.plan import Plan
from autopipe.examples import TinyGPT
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from executor.grad_norm import NonFiniteNormError
from executor.ranks.grad_scaler import PipelineGradScaler
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import CHUNKS, Case, _case, _close, _ok, _reference, spawn

SMALL = 0.05  # clips: every gradient scaled
# one stage per rank, and two per rank (0, 2 | 1, 3): the head tied to the embedding either way
SCHEDULES = (("gpipe", 2), ("interleaved1f1b", 4))


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt() -> Case:
    torch.manual_seed(0)
    model = TinyGPT(vocab=16, dim=8, heads=2, layers=2, max_len=4)  # head tied to the embedding
    return model, (torch.randint(0, 16, (8, 4)),), torch.randint(0, 16, (8, 4)), _lm_loss


def _plan(stages: int, schedule: str) -> Plan:
    """A plan of made-up costs (nothing measured: fast, the same on both ranks)."""
    model, inputs, _, _ = _gpt()
    graph = trace(model, microbatch_inputs(inputs, CHUNKS))
    return partition(cost_profile(graph), stages=stages, method="uniform", chunks=CHUNKS,
                     schedule=schedule)


def _grads(pipe: Any) -> dict[str, Tensor]:
    return {n: p.grad.clone() for s in pipe.stages for n, p in s.named_parameters()}


def _clip(rank: int) -> list[dict[str, Any]]:
    out = []
    for schedule, stages in SCHEDULES:
        model, inputs, target, loss_fn = _gpt()
        pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, plan=_plan(stages, schedule),
                                    timeout=20)
        pipe.step(*inputs, target=target)
        inf = pipe.clip_grad_norm_(1e9, math.inf)  # the inf norm, nothing clipped
        two = pipe.clip_grad_norm_(SMALL)
        out.append({"ties": len(pipe._ties), "indices": pipe.indices, "inf": inf, "two": two,
                    "grads": _grads(pipe)})
    return out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_clipped_norm_and_grads_of_a_tied_gpt_on_two_ranks_equal_one_process() -> None:
    values = _ok(spawn(_clip))
    for k, (schedule, _) in enumerate(SCHEDULES):
        model, inputs, target, loss_fn = _gpt()
        _reference(model, inputs, target, loss_fn)
        inf = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, math.inf)
        two = torch.nn.utils.clip_grad_norm_(model.parameters(), SMALL)
        assert two > 10 * SMALL, schedule  # the clip does scale
        assert [v[k]["ties"] for v in values] == [1, 1], schedule  # wte / lm_head on both ranks
        assert values[0][k]["indices"] == ([0] if schedule == "gpipe" else [0, 2])
        covered = set()
        for rank, v in enumerate(values):
            _close(v[k]["inf"], inf, f"{schedule} rank {rank} inf norm")
            _close(v[k]["two"], two, f"{schedule} rank {rank} 2-norm")
            for key, grad in v[k]["grads"].items():  # the tied copy on both ranks
                p = model.get_parameter(key)
                _close(grad, p.grad, f"{schedule} rank {rank} {key}")
                covered.add(id(p))
        assert covered == {id(p) for p in model.parameters()}


INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
OVERFLOWS = [True, False, False]  # rank 0's gradient overflows in the first step only


def _fp16_steps(rank: int) -> list[dict[str, Any]]:
    model, inputs, target, loss_fn = _case("mlp")
    pipe = distributed_pipeline(model, inputs, loss_fn=loss_fn, chunks=CHUNKS, method="uniform",
                                timeout=20)
    scaler = PipelineGradScaler(pipe, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=0.1)
    first = next(iter(pipe.stage_module.parameters()))
    out = []
    for overflow in OVERFLOWS:
        opt.zero_grad()
        hook = first.register_hook(lambda g: g * math.inf) if overflow and rank == 0 else None
        loss = pipe.step(*inputs, target=target, scaler=scaler)
        if hook is not None:
            hook.remove()
        scaler.unscale_(opt)
        grads = _grads(pipe)
        refused = None
        try:  # rank 1's own gradients are finite: the norm over both ranks is not
            pipe.clip_grad_norm_(1e9, error_if_nonfinite=True)
        except NonFiniteNormError as err:
            refused = str(err)
        norm = pipe.clip_grad_norm_(1e9)
        before = [p.detach().clone() for p in pipe.stage_module.parameters()]
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, pipe.stage_module.parameters(), strict=True))
        out.append({"loss": loss, "grads": grads, "norm": norm, "moved": moved, "refused": refused,
                    "scale": scaler.get_scale(),
                    "state": {n: p.detach().clone() for n, p in pipe.stage_module.named_parameters()}})
    return out


def _torch_scales(overflows: list[bool]) -> list[float]:
    """torch.amp.GradScaler's scale after each step, given which steps overflowed."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for overflow in overflows:
        scaler.scale(w.sum() * (math.inf if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales


@pytest.mark.timeout(90)
def test_an_inf_on_one_rank_skips_the_step_on_both_and_the_scale_moves_as_torchs() -> None:
    values = _ok(spawn(_fp16_steps))
    scales = _torch_scales(OVERFLOWS)
    assert scales == [INIT_SCALE / 2, INIT_SCALE / 2, INIT_SCALE]  # backoff, then growth after 2
    model, inputs, target, loss_fn = _case("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, overflow in enumerate(OVERFLOWS):
        for rank, v in enumerate(values):
            assert v[step]["scale"] == scales[step], f"rank {rank} step {step}"
            assert v[step]["moved"] is (not overflow), f"rank {rank} step {step}"  # rank 1 skips too
            assert math.isfinite(v[step]["norm"]) is (not overflow)
            refused = v[step]["refused"]
            assert (refused is not None) is overflow, f"rank {rank} step {step}"
            assert refused is None or (refused.startswith("the total gradient norm of order 2.0 is ")
                                       and "\n" not in refused)
        if overflow:
            continue
        opt.zero_grad()
        loss = _reference(model, inputs, target, loss_fn)
        assert_close(values[1][step]["loss"], loss)  # unscaled
        assert values[0][step]["loss"] is None
        for rank, v in enumerate(values):
            for name, grad in v[step]["grads"].items():  # unscaled
                _close(grad, model.get_parameter(name).grad, f"rank {rank} step {step} {name}")
        opt.step()
        for rank, v in enumerate(values):
            for name, value in v[step]["state"].items():
                _close(value, model.get_parameter(name), f"rank {rank} step {step} {name}")
