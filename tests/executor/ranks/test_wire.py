"""[Note: what crosses a cut]: a cut's values cross ranks exactly, sized for any input size."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from executor.errors import DistributedError
from executor.ranks.messages import pack, unpack
from executor.ranks.wire import (
    Wire,
    WireStage,
    _chain,
    _decode,
    _encode,
    check_sizes,
    cut_metas,
    infer_wires,
    input_sizes,
    slots,
    wire_metas,
)

CPU = torch.device("cpu")


class First(nn.Module):
    """Stage 0: two activations that need a gradient, a size as an ``int``, a mask, a constant
    and the input's ``torch.Size``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        return self.a(x), self.b(x), x.size(1), x[..., 0] > 0, None, x.shape


class Last(nn.Module):
    """Stage 1: a pytree output whose ``n`` is a Python value (a constant leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, r: torch.Tensor, n: int, mask: torch.Tensor, none: None,
                shape: torch.Size) -> dict[str, Any]:
        assert none is None and isinstance(shape, torch.Size)
        return {"logits": (self.c(h + r) * mask.unsqueeze(-1)).sum(1) / n + shape[0], "n": n}


def _stages() -> list[nn.Module]:
    return [First(), Last()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _plain(w: Wire) -> Wire:
    return replace(w, shape_formula=None)


def test_wire_of_each_kind_of_value() -> None:
    t = torch.randn(2, 0, 3, requires_grad=True)
    w = Wire.of(t)
    assert (w.kind, w.shape, w.dtype, w.requires_grad) == ("tensor", (2, 0, 3), torch.float32, True)
    assert w.stride == torch.empty(2, 0, 3).stride()  # as sent: contiguous, a size 0 kept
    assert Wire.of(3) == Wire("scalar", int, dtype=torch.int64)
    assert Wire.of(True) == Wire("scalar", bool, dtype=torch.int64)
    assert Wire.of(0.5) == Wire("scalar", float, dtype=torch.float64)
    for ints in (torch.Size([2, 3]), (2, 3), [2, 3]):
        assert Wire.of(ints) == Wire("ints", type(ints), shape=(2,), stride=(1,))
    for const in (None, "causal", torch.float16, (), (True, False), (1, "a")):
        assert Wire.of(const).kind == "const" and Wire.of(const).value is const
        assert Wire.of(const).meta() is None
    meta = Wire.of(t).meta()
    assert meta is not None and meta.device.type == "meta"
    assert (meta.shape, meta.stride(), meta.requires_grad) == (t.shape, t.stride(), True)


def test_values_cross_a_cut_bit_for_bit_with_their_python_types() -> None:
    hidden = torch.tensor([[0.1, -0.0, float("nan")], [float("inf"), 1e-40, -3.5]], requires_grad=True)
    values = (hidden, 7, 2**40, 0.1, True, torch.Size([2, 3]), [4, 5], (6,), None, "causal",
              torch.float16, torch.rand(2, 3) > 0.5, torch.arange(3), torch.randn(2, dtype=torch.bfloat16))
    wires = tuple(Wire.of(v) for v in values)
    messages = pack(_encode(values, wires, CPU), slots(wires))
    for m, meta in zip(messages, cut_metas(wires), strict=True):  # the receive buffers fit
        assert (m.shape, m.dtype, m.requires_grad) == (meta.shape, meta.dtype, meta.requires_grad)
    received = [m.detach().clone().requires_grad_(m.requires_grad) for m in messages]
    back = _decode(unpack(received, slots(wires)), wires)
    assert len(back) == len(values)
    for got, sent in zip(back, values, strict=True):
        if isinstance(sent, torch.Tensor):
            assert (got.shape, got.dtype, got.requires_grad) == (sent.shape, sent.dtype, sent.requires_grad)
            assert torch.equal(_bits(got), _bits(sent))
        else:
            assert type(got) is type(sent) and got == sent


def test_a_wrong_count_or_a_changed_constant_is_refused() -> None:
    wires = (Wire.of(torch.zeros(2)), Wire.of(None))
    with pytest.raises(DistributedError, match="a stage returned 1 values but its cut carries 2"):
        _encode((torch.zeros(2),), wires, CPU)
    with pytest.raises(DistributedError,
                       match="cut value 1 was the constant None when the pipeline was built but is 3"):
        _encode((torch.zeros(2), 3), wires, CPU)
    assert len(_encode((torch.zeros(2), None), wires, CPU)) == 1  # the constant is not sent


def test_a_floating_tensor_crosses_in_its_wire_dtype_and_its_gradient_comes_back_in_its_own() -> None:
    wire = Wire.of(torch.zeros(3))  # probed in fp32
    value = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)  # a step under autocast
    (sent,) = _encode((value,), (wire,), CPU)
    assert sent.dtype == torch.float32
    assert torch.equal(_bits(sent.to(torch.bfloat16)), _bits(value))  # bf16 -> fp32 is exact
    sent.backward(torch.full((3,), 2.0))
    assert value.grad is not None and value.grad.dtype == torch.bfloat16
    assert torch.equal(value.grad, torch.full((3,), 2.0, dtype=torch.bfloat16))


def test_infer_wires_sees_every_cut() -> None:
    x = torch.randn(2, 3, 4)
    wires = infer_wires(_stages(), (x,))
    assert len(wires) == 3  # the inputs, stage 1's inputs, the loss's tensor leaves
    assert [_plain(w) for w in wires[0]] == [Wire.of(x)]
    assert [w.kind for w in wires[1]] == ["tensor", "tensor", "scalar", "tensor", "const", "ints"]
    assert [w.requires_grad for w in wires[1]] == [True, True, False, False, False, False]
    assert wires[1][5].pytype is torch.Size
    assert [(w.kind, w.shape) for w in wires[2]] == [("tensor", (2, 2))]  # "n" is no tensor leaf


def test_wires_at_another_size_are_those_of_a_real_run_at_that_size() -> None:
    stages = _stages()
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    y = torch.randn(5, 7, 4)
    real = infer_wires(stages, (y,))
    at = [[_plain(w.at(input_sizes((y,)))) for w in cut] for cut in wires]
    assert at == [[_plain(w) for w in cut] for cut in real]
    assert at[1][0].shape != wires[1][0].shape  # not the example's
    # and what the stages really produce at that size
    values = _chain(stages, (y,))
    for cut, vals in zip(at, values, strict=True):
        for w, v in zip(cut, vals, strict=True):
            if w.kind == "tensor":
                assert (w.shape, w.stride) == (tuple(v.shape), v.contiguous().stride())
    # a wire without formulas stays at the example's size
    assert Wire.of(torch.zeros(2, 3)).at(((9, 9),)) == Wire.of(torch.zeros(2, 3))


def test_infer_wires_refuses_inputs_that_are_not_tensors() -> None:
    with pytest.raises(DistributedError, match=r"model inputs \[1\] are not tensors"):
        infer_wires(_stages(), (torch.randn(2, 3, 4), 3))


def test_a_probe_run_leaves_buffers_rng_and_mode_as_they_were() -> None:
    stage = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 4)).train()
    stage[0].running_mean.fill_(0.25)
    x = torch.randn(3, 4) + 5
    buffers = {k: v.clone() for k, v in stage.state_dict().items()}
    rng = torch.get_rng_state()
    infer_wires([stage], (x,))
    for k, v in stage.state_dict().items():
        assert torch.equal(v, buffers[k]), k
    after = torch.rand(8)
    torch.set_rng_state(rng)
    assert torch.equal(after, torch.rand(8))  # the dropout drew nothing from the step's RNG
    assert stage.training
    stage(x)  # while a real run does move the statistics (so the check above means something)
    assert not torch.equal(stage[0].running_mean, buffers["0.running_mean"])


def test_wires_under_autocast_have_the_autocast_dtype() -> None:
    stage, x = nn.Linear(4, 4), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = stage(x).dtype
    assert want == torch.bfloat16
    assert infer_wires([stage, nn.Identity()], (x,), precision="bf16")[1][0].dtype == want
    assert infer_wires([stage, nn.Identity()], (x,))[1][0].dtype == torch.float32


def test_check_sizes_accepts_free_dimensions_and_names_the_first_fixed_one() -> None:
    stages = _stages()
    inputs = infer_wires(stages, (torch.randn(2, 3, 4),))[0]
    assert check_sizes(inputs, ((6, 9, 4),), ["x"]) == ""
    assert check_sizes(inputs, (None,)) == ""  # not a tensor: nothing to check
    with pytest.raises(RuntimeError):  # what the check saves a rank from
        stages[0](torch.randn(6, 9, 5))
    assert check_sizes(inputs, ((6, 9, 5),), ["x"]) == (
        "dimension 2 of input 'x' is 5, but the pipeline runs 4 there: its stages fix it; "
        "pass inputs with 4 in dimension 2")
    assert check_sizes(inputs, ((6, 9),)).startswith(
        "model input 0 has 2 dimensions but the pipeline was built for 3 ([2, 3, 4])")
    # built with a size of 1, which torch fixes
    ones = infer_wires(_stages(), (torch.randn(2, 1, 4),))[0]
    assert "it was built with that size (torch fixes sizes 0 and 1): build with >= 2" in \
        check_sizes(ones, ((2, 3, 4),))
    # no formulas: only the example's sizes
    assert "it was built for the example's sizes only" in \
        check_sizes((Wire.of(torch.zeros(2, 3, 4)),), ((5, 3, 4),))


def test_input_sizes_and_wire_metas() -> None:
    assert input_sizes((torch.zeros(2, 3), 3, None, torch.tensor(1.0))) == ((2, 3), None, None, ())
    wires = (Wire.of(torch.zeros(2, 3, requires_grad=True)), Wire.of(None), Wire.of(4))
    metas = wire_metas(wires)
    assert [(m.shape, m.dtype, m.requires_grad) for m in metas] == [
        ((2, 3), torch.float32, True), ((), torch.int64, False)]


def _wire_pair(stages: list[nn.Module], wires: Any) -> tuple[WireStage, WireStage]:
    """The two stages as a pipeline of two ranks runs them, on the wires between them."""
    return (WireStage(stages[0], wires[0], wires[1], first=True, last=False, device=CPU),
            WireStage(stages[1], wires[1], wires[2], first=False, last=True, device=CPU))


def _across(first: WireStage, last: WireStage, x: torch.Tensor,
            loss_of: Callable[[Any], torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """One step across the cut at ``x``'s sizes, as two ranks take it: the messages sent, received
    as fresh tensors, ``loss_of`` the last stage's output back-propagated and the received
    gradients sent back. The last stage's output and the messages."""
    for w in (first, last):
        w.use(input_sizes((x,)))
        w.zero_grad(set_to_none=True)
    messages = first(x)
    received = [m.detach().clone().requires_grad_(m.requires_grad) for m in messages]
    out = last.unflatten(last(*received))
    loss_of(out).backward()
    sent = [(m, r.grad) for m, r in zip(messages, received, strict=True) if m.requires_grad]
    torch.autograd.backward([m for m, _ in sent], [g for _, g in sent])
    return out, messages


def test_wire_stages_run_as_the_plain_model_with_the_same_gradients_at_any_size() -> None:
    stages = _stages()
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    ref = copy.deepcopy(stages)
    first, last = _wire_pair(stages, wires)
    for x in (torch.randn(2, 3, 4), torch.randn(4, 6, 4)):
        out, _ = _across(first, last, x, lambda out: out["logits"].square().sum())
        want = ref[1](*ref[0](x))
        assert out["n"] == want["n"] == x.shape[1]
        assert_close(out["logits"], want["logits"])
        for r in ref:
            r.zero_grad(set_to_none=True)
        want["logits"].square().sum().backward()
        for s, r in zip(stages, ref, strict=True):
            for (name, p), q in zip(s.named_parameters(), r.parameters(), strict=True):
                assert_close(p.grad, q.grad, msg=name)


class Logits(nn.Module):
    """Stage 0 of an LM cut before its loss: the logits it returns and the view the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        return logits, logits.view(-1, 6), x.sum(-1)  # the last: no view, though of x's size


class Loss(nn.Module):
    def forward(self, logits: torch.Tensor, flat: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": flat.logsumexp(-1).mean() + other.square().mean(), "logits": logits}


def test_a_view_crosses_once_and_its_gradient_flows_into_its_source_at_any_size() -> None:
    # [Note: a view crosses once]
    stages = [Logits(), Loss()]
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    assert [w.kind for w in wires[1]] == ["tensor", "view", "tensor"] and wires[1][1].value == 0
    assert len(slots(wires[1])) == 2 and len(cut_metas(wires[1])) == 2  # one buffer for the logits
    ref = copy.deepcopy(stages)
    first, last = _wire_pair(stages, wires)
    for x in (torch.randn(2, 3, 4), torch.randn(5, 7, 4)):
        out, messages = _across(first, last, x, lambda out: out["loss"] + out["logits"].sum())
        assert len(messages) == 2
        for r in ref:
            r.zero_grad(set_to_none=True)
        want = ref[1](*ref[0](x))
        (want["loss"] + want["logits"].sum()).backward()
        assert_close(out["loss"], want["loss"])
        assert_close(stages[0].head.weight.grad, ref[0].head.weight.grad)
        assert_close(stages[0].head.bias.grad, ref[0].head.bias.grad)


def test_a_view_that_is_no_longer_one_is_refused_in_one_line() -> None:
    logits = torch.randn(2, 3, 6)
    wires = (Wire.of(logits), replace(Wire.of(logits.view(-1, 6)), kind="view", value=0))
    assert len(_encode((logits, logits.view(-1, 6)), wires, CPU)) == 1
    with pytest.raises(DistributedError, match="cut value 1 was a view of value 0 when the pipeline was built") as info:
        _encode((logits, logits.view(-1, 6).clone()), wires, CPU)
    assert "\n" not in str(info.value)
