"""fp16 loss scaling in one process: torch.amp.GradScaler on executor.GPipe as on the plain model.

On ranks, executor.ranks.grad_scaler.PipelineGradScaler (tests/assemble/test_ranks_clip.py and
tests/assemble/test_replicas.py): [Note: loss scaling on ranks].
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import executor._torch_compat as compat
from executor.local.gpipe import GPipe
from tests.executor.local.test_gpipe import chain_stages
from tests.models import Chain


def test_torchs_grad_scaler_skips_an_overflow_on_one_stage_and_steps_a_clean_one() -> None:
    model = Chain()
    ref = copy.deepcopy(model)
    pipe = GPipe(chain_stages(model, 3), ["cpu"] * 3, chunks=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    hook = model.net[-1].weight.register_hook(lambda g: g * math.inf)  # the last stage overflows
    scaler.scale(pipe(x).pow(2).mean()).backward()
    hook.remove()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    assert not pipe.clip_grad_norm_(1.0).isfinite()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))  # skipped
    assert scaler.get_scale() == 2.0**9  # backed off
    opt.zero_grad()
    scaler.scale(pipe(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    ref(x).pow(2).mean().backward()
    assert_close(pipe.clip_grad_norm_(0.01), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    scaler.step(opt)
    scaler.update()
    ref_opt.step()
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert_close(q, p)  # unscaled, clipped and stepped as the plain model


@pytest.mark.compat  # a private torch method: checked on every supported torch
def test_found_inf_flags_are_the_ones_step_reads() -> None:
    """executor._torch_compat.found_inf_per_device: the dict torch's step and update read."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    flags = compat.found_inf_per_device(scaler, opt)
    assert [float(f) for f in flags.values()] == [0.0]
    for flag in flags.values():
        flag.fill_(1.0)  # as PipelineGradScaler shares another rank's overflow
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), torch.ones(2)) and scaler.get_scale() == 2.0
