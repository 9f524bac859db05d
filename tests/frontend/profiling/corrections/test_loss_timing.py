"""[Note: the loss in the last stage]: the loss timed per micro-batch, charged to the last layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import autopipe
from autopipe.core.cost import LayerCosts
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.corrections.loss_timing import with_loss
from autopipe.solvers.synthetic import random_chain
from tests.models import Chain


def _chain() -> tuple[nn.Module, Tensor, Tensor, Profile]:
    model, x = Chain(), torch.randn(16, 8)
    target = torch.randint(0, 4, (16,))
    prof = autopipe.profile(model, (x,), chunks=2, repeats=2, warmup=0, progress=False)
    return model, x, target, prof


def test_the_loss_is_timed_on_one_micro_batch_and_the_model_left_as_it_was() -> None:
    model, x, target, prof = _chain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    timed = with_loss(prof, model, (x,), target, F.cross_entropy)
    loss = timed.corrections.loss
    assert loss is not None and loss.fwd_ms > 0 and loss.bwd_ms > 0
    assert loss.micro_batch_size == 8 and prof.corrections.loss is None
    assert dataclasses.replace(timed.corrections, loss=None) == prof.corrections  # its own field only
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_the_loss_s_bytes_are_what_cross_entropy_keeps_and_has_alive() -> None:
    model, x, target, prof = _chain()
    loss = with_loss(prof, model, (x,), target, F.cross_entropy).corrections.loss
    assert loss is not None
    logits = 8 * 4 * 4  # one micro-batch's: 8 rows x 4 classes x fp32
    # the forward keeps its log-softmax (and the loss and nll's total weight, 4 bytes each); its
    # backward has alive besides the gradient of the log-softmax and that of the logits
    assert (loss.held_bytes, loss.peak_bytes) == (logits + 8, 3 * logits + 8)
    twice = profile_at(dataclasses.replace(prof, corrections=dataclasses.replace(prof.corrections, loss=loss)),
                       16).corrections.loss
    assert twice is not None and (twice.held_bytes, twice.peak_bytes) == (2 * (logits + 8), 2 * (3 * logits + 8))


def test_the_last_layer_and_so_the_last_stage_pays_it() -> None:
    base = random_chain(6, 2)
    prof = Profile(base.df, base.edges, {**base.meta, "loss_fwd_ms": 0.25, "loss_bwd_ms": 0.5})
    plain, charged = LayerCosts.from_profile(base), LayerCosts.from_profile(prof)
    assert charged.bwd[-1] == pytest.approx(plain.bwd[-1] + 0.75)
    assert list(charged.bwd[:-1]) == list(plain.bwd[:-1]) and list(charged.fwd) == list(plain.fwd)
    assert list(base.df["bwd_ms"]) == list(prof.df["bwd_ms"])  # the table itself is not touched
    layers = base.layers
    for checkpoint in ("never", "always"):  # a backward is never recomputed
        a = Plan.from_stages(base, [layers[:3], layers[3:]], devices=["a", "b"], chunks=2, recompute=checkpoint)
        b = Plan.from_stages(prof, [layers[:3], layers[3:]], devices=["a", "b"], chunks=2, recompute=checkpoint)
        assert b.stage_times[0] == pytest.approx(a.stage_times[0])
        assert b.stage_times[1] == pytest.approx(a.stage_times[1] + 0.75)


def test_at_another_micro_batch_the_loss_scales_with_the_rows() -> None:
    base = random_chain(4, 1)
    prof = Profile(base.df, base.edges, {**base.meta, "micro_batch_size": 8, "loss_fwd_ms": 0.4,
                                          "loss_bwd_ms": 0.8})
    half = profile_at(prof, 4)
    loss = half.corrections.loss
    assert loss is not None and (loss.fwd_ms, loss.bwd_ms) == (pytest.approx(0.2), pytest.approx(0.4))
    assert loss.micro_batch_size == 4
    assert profile_at(prof, 8).corrections.loss == prof.corrections.loss


def test_bad_losses_and_targets_say_what_to_do() -> None:
    model, x, target, prof = _chain()

    def broken(out: Tensor, tgt: Tensor) -> Tensor:
        raise ValueError("shapes do not match")

    with pytest.raises(ProfileError, match=r"^loss_fn\(output, target\) failed on one micro-batch \(ValueError: "
                                           r"shapes do not match\); pass the loss"):
        with_loss(prof, model, (x,), target, broken)
    with pytest.raises(ProfileError, match=r"returned Tensor of shape \(8, 4\); it must return a scalar"):
        with_loss(prof, model, (x,), target, lambda out, tgt: out)
    with pytest.raises(ProfileError, match=r"the target has 12 rows and the inputs 16; pass the target"):
        with_loss(prof, model, (x,), target[:12], F.cross_entropy)
    with pytest.raises(ProfileError, match=r"measured on a batch of 16 rows, these inputs have 8"):
        with_loss(prof, model, (x[:8],), target[:8], F.cross_entropy)
    with pytest.raises(ProfileError, match=r"^target: example inputs hold no tensor with a batch dimension"):
        with_loss(prof, model, (x,), torch.tensor(1), F.cross_entropy)


def test_a_model_never_run_whole_keeps_no_loss_time() -> None:
    model, x, target, prof = _chain()
    with torch.device("meta"):
        ghost = Chain()
    assert with_loss(prof, ghost, (x,), target, F.cross_entropy) is prof
    assert with_loss(prof, model, (x,), None, F.cross_entropy) is prof  # no target or loss given
    assert with_loss(prof, model, (x,), target, None) is prof
    layers = autopipe.profile(model, (x,), chunks=2, mode="layers", repeats=1, warmup=0, progress=False)
    assert with_loss(layers, model, (x,), target, F.cross_entropy) is layers  # it may not fit whole


def test_profile_with_the_loss_records_it_as_its_own_step() -> None:
    model, x = Chain((8, 16, 4)), torch.randn(16, 8)
    target = torch.randint(0, 4, (16,))
    prof = autopipe.profile(model, (x,), chunks=2, repeats=1, warmup=0, progress=False,
                            loss_fn=F.cross_entropy, target=target)
    loss = prof.corrections.loss
    assert loss is not None and loss.fwd_ms > 0 and loss.micro_batch_size == 8
    assert "gpipe" in prof.corrections.stage_calls and prof.corrections.transfer is None  # comm=False
    for bad, message in (({"loss_fn": F.cross_entropy}, r"^loss_fn was given without target; pass both"),
                         ({"target": target}, r"^target was given without loss_fn; pass both"),
                         ({"loss_fn": 3, "target": target}, r"^loss_fn must be callable"),
                         ({"comm": "yes"}, r"^comm must be True or False, got 'yes'")):
        with pytest.raises(ProfileError, match=message):
            autopipe.profile(model, (x,), chunks=2, repeats=1, warmup=0, **bad)
