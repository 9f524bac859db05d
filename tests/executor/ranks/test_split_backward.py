"""[Note: split backward on ranks]: input gradients at the I, weight ones at the W, as plain."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from executor.ranks.split_backward import (
    WeightGrads,
    _reverse_edges,
    split_backward,
    split_call,
    weight_groups,
)

CPU = torch.device("cpu")


class Net(nn.Module):
    """Two layers and a parameter the graph never uses; a second output of integers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin2(torch.tanh(self.lin1(x))), ids * 2


class Twice(nn.Module):
    """One layer used twice: its intermediates lie one below the other, in one group."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(torch.tanh(self.lin(x))),)


class Bypass(nn.Module):
    """An output of the weights alone (no input on its path): the split cannot reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.lin.weight.sum(0) * 3


class Reentrant(nn.Module):
    """torch's reentrant checkpoint, which refuses autograd.grad(inputs=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (checkpoint(self.net, x, use_reentrant=True),)


def _leaf(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_(grad)


def _split_step(module: nn.Module, inputs: tuple[torch.Tensor, ...], weights: WeightGrads,
                seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The I: forward as one split node and backward from fixed output gradients (returned)."""
    out = split_call(module, inputs, CPU, weights)
    floating = [y for y in out if y.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(y.shape, generator=gen) for y in floating]
    torch.autograd.backward(floating, grads)
    return list(out), grads


def _plain_step(module: nn.Module, inputs: tuple[torch.Tensor, ...], grads: list[torch.Tensor]) -> None:
    out = [y for y in module(*inputs) if y.requires_grad]
    torch.autograd.backward(out, grads)


def _copy(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)


def _assert_same_grads(got: nn.Module, want: nn.Module) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert_close(p.grad, q.grad, msg=name)


def _no_grads(module: nn.Module) -> bool:
    return all(p.grad is None for p in module.parameters())


def test_input_gradients_at_the_i_weight_gradients_at_the_w() -> None:
    net = Net()
    ref = copy.deepcopy(net)
    inputs = (_leaf(5, 3), torch.arange(5))
    weights = WeightGrads(net.parameters)
    out, grads = _split_step(net, inputs, weights)
    assert torch.equal(out[1], inputs[1] * 2) and not out[1].requires_grad  # integers: no gradient
    plain = _copy(inputs)
    _plain_step(ref, plain, grads)
    assert_close(inputs[0].grad, plain[0].grad)
    assert _no_grads(net)  # the weight part waits for the W
    run = weights.builder()
    run()
    _assert_same_grads(net, ref)
    assert net.unused.grad is None
    weights.builder()()  # the queue was handed over: nothing is counted twice
    _assert_same_grads(net, ref)


def test_a_layer_used_twice_gets_its_gradient_once() -> None:
    net = Twice()
    ref = copy.deepcopy(net)
    inputs = (_leaf(4, 3),)
    weights = WeightGrads(net.parameters)
    _, grads = _split_step(net, inputs, weights)
    plain = _copy(inputs)
    _plain_step(ref, plain, grads)
    assert_close(inputs[0].grad, plain[0].grad)
    assert _no_grads(net)
    weights.builder()()
    _assert_same_grads(net, ref)


def test_the_ws_of_two_micro_batches_add_up_in_any_order() -> None:
    net = Net()
    ref = copy.deepcopy(net)
    weights = WeightGrads(net.parameters)
    runs = []
    for seed in (1, 2):
        inputs = (_leaf(2, 3), torch.arange(2))
        _, grads = _split_step(net, inputs, weights, seed)
        runs.append(weights.builder())  # PipelineStage takes it right after each backward
        _plain_step(ref, _copy(inputs), grads)
    assert _no_grads(net)
    for run in reversed(runs):
        run()
    _assert_same_grads(net, ref)


def test_a_whole_backward_gives_both_halves_at_once() -> None:
    net = Net()
    ref = copy.deepcopy(net)
    inputs = (_leaf(5, 3), torch.arange(5))
    weights = WeightGrads(net.parameters)
    weights.whole = True  # torch's B
    _, grads = _split_step(net, inputs, weights)
    plain = _copy(inputs)
    _plain_step(ref, plain, grads)
    assert_close(inputs[0].grad, plain[0].grad)
    _assert_same_grads(net, ref)
    weights.builder()()
    _assert_same_grads(net, ref)


def test_a_stage_whose_inputs_need_no_gradient_runs_its_whole_backward_at_the_w() -> None:
    net = Net()
    ref = copy.deepcopy(net)
    inputs = (_leaf(5, 3, grad=False), torch.arange(5))  # the first stage: the phony keeps the node
    weights = WeightGrads(net.parameters)
    _, grads = _split_step(net, inputs, weights)
    assert _no_grads(net)
    _plain_step(ref, inputs, grads)
    weights.builder()()
    _assert_same_grads(net, ref)


@pytest.mark.parametrize("module", [Bypass, Reentrant])
def test_a_graph_the_split_cannot_cut_runs_its_whole_backward_at_the_i(module: Callable[[], nn.Module]) -> None:
    net = module()
    ref = copy.deepcopy(net)
    inputs = (_leaf(5, 3),)
    weights = WeightGrads(net.parameters)
    _, grads = _split_step(net, inputs, weights)
    plain = _copy(inputs)
    _plain_step(ref, plain, grads)
    assert_close(inputs[0].grad, plain[0].grad)
    _assert_same_grads(net, ref)  # already: nothing was left for the W
    assert all(p.grad is not None for p in net.parameters())
    weights.builder()()
    _assert_same_grads(net, ref)


def test_weight_groups_meet_the_input_path_where_each_layer_takes_it() -> None:
    net = Net()
    x = _leaf(5, 3)
    a = net.lin1(x)
    y = net.lin2(torch.tanh(a))
    roots = [y.grad_fn]
    reverse, reentrant = _reverse_edges(roots)
    assert not reentrant
    accumulators, groups = weight_groups(roots, reverse, [x], net.parameters())
    used = [net.lin1.weight, net.lin1.bias, net.lin2.weight, net.lin2.bias]
    assert sorted(map(id, accumulators.values())) == sorted(map(id, used))  # not net.unused
    assert groups is not None

    def named(group: tuple[set, set]) -> tuple[frozenset[int], frozenset[int]]:
        params, met = group
        return frozenset(id(accumulators[n]) for n in params), frozenset(map(id, met))

    assert {named(g) for g in groups} == {
        (frozenset(map(id, used[:2])), frozenset([id(a.grad_fn)])),
        (frozenset(map(id, used[2:])), frozenset([id(y.grad_fn)])),
    }
    # an output of a weight alone: no split
    z = net.lin2.weight.sum()
    roots = [y.grad_fn, z.grad_fn]
    reverse, _ = _reverse_edges(roots)
    assert weight_groups(roots, reverse, [x], net.parameters())[1] is None


def test_reverse_edges_sees_a_reentrant_checkpoint() -> None:
    (y,) = Reentrant()(_leaf(2, 3))
    assert _reverse_edges([y.grad_fn])[1]


def test_weight_grads_hands_over_its_queue_once_and_clears_it() -> None:
    weights = WeightGrads(list)
    done: list[int] = []
    weights.queue(lambda: done.append(1))
    weights.queue(lambda: done.append(2))
    run = weights.builder()
    assert done == []
    weights.builder()()  # a new W: nothing queued since
    run()
    assert done == [1, 2]
    weights.queue(lambda: done.append(3))
    weights.clear()  # what a failed step left
    weights.builder()()
    assert done == [1, 2]


def test_no_output_gradient_means_nothing_to_do() -> None:
    net = Net()
    weights = WeightGrads(net.parameters)
    x = _leaf(5, 3)
    out, _ = net(x, torch.arange(5))
    assert split_backward([out], [None], [x, torch.arange(5)], weights) == [None, None]
    weights.builder()()
    assert _no_grads(net) and x.grad is None


def test_a_split_node_refuses_a_second_backward() -> None:
    net = Twice()
    (y,) = split_call(net, (_leaf(2, 3),), CPU, WeightGrads(net.parameters))
    y.sum().backward(retain_graph=True)
    with pytest.raises(AssertionError, match="a split stage's backward ran twice"):
        y.sum().backward()
