from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from executor.errors import ExecutorError
from executor.microbatch import Batch
from executor.recompute import (
    Checkpointing,
    depend,
    fork,
    get_phony,
    is_checkpointing,
    is_recomputing,
    join,
    recompute_stop,
)


def test_checkpoint_stop_per_mode() -> None:
    assert recompute_stop("always", 4) == 4
    assert recompute_stop("except_last", 4) == 3
    assert recompute_stop("never", 4) == 0
    assert recompute_stop("always", 4, enabled=False) == 0


def test_unknown_mode() -> None:
    with pytest.raises(ExecutorError, match=r"recompute='all' is not a recompute mode; use one"):
        recompute_stop("all", 2)


def _checkpointed(fn: nn.Module, *inputs: Tensor) -> Batch:
    chk = Checkpointing(lambda b: b.call(fn), Batch(inputs), torch.device("cpu"))
    return chk.recompute(chk.checkpoint())


def test_gradients_equal_plain_autograd_with_dropout() -> None:
    net = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(5, 6, requires_grad=True)
    torch.manual_seed(7)
    out = _checkpointed(net, x).output()
    out.pow(2).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in net.parameters()]
    x.grad = None
    net.zero_grad()
    torch.manual_seed(7)
    want = net(x)
    want.pow(2).sum().backward()
    torch.testing.assert_close(out, want)
    for a, b in zip(got, [x.grad] + [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(a, b)


def test_checkpoint_saves_only_inputs() -> None:
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(8, 32)
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _checkpointed(net, x)
    assert saved and all(t is x for t in saved)  # both nodes keep the input itself, nothing else


@pytest.mark.parametrize("lane", [True, False])
def test_recomputes_when_the_gradient_arrives_without_a_lane_or_past_an_unused_output(lane: bool) -> None:
    # the distributed runtime adds no lane; on a last stage the lane may hang on an output the
    # loss never uses: either way backward recomputes then, and the unused head gets None
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused, self.used = nn.Linear(4, 3), nn.Linear(4, 2)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return self.unused(x), self.used(torch.nn.functional.dropout(x, 0.5))

    net, x = TwoHeads(), torch.randn(6, 4)  # an input without grad, as a first stage gets
    torch.manual_seed(3)
    chk = Checkpointing(lambda b: b.call(net), Batch((x,)), torch.device("cpu"))
    out = chk.recompute(chk.checkpoint()) if lane else chk.checkpoint()
    out.values[1].square().sum().backward()
    got = {name: p.grad for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    net(x)[1].square().sum().backward()
    for name, p in net.named_parameters():
        if name.startswith("unused"):
            assert got[name] is None and p.grad is None, name
        else:
            torch.testing.assert_close(got[name], p.grad)


def test_flags_and_pass_through_non_tensors() -> None:
    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor, n: int) -> tuple[Tensor, int, Tensor]:
            seen.append((is_checkpointing(), is_recomputing()))
            return self.lin(x) * n, n, x  # x passes through unchanged

    x = torch.randn(2, 3, requires_grad=True)
    out = _checkpointed(Probe(), x, 3)
    y, n, skip = out.values
    assert n == 3 and seen == [(True, False)]
    (y.sum() + skip.sum()).backward()
    assert seen == [(True, False), (False, True)]
    assert not is_checkpointing() and not is_recomputing()
    assert x.grad is not None


def _reaches(node: object, target: object) -> bool:
    stack, seen = [node], set()
    while stack:
        fn = stack.pop()
        if fn is target:
            return True
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        stack += [nxt for nxt, _ in getattr(fn, "next_functions", ())]
    return False


def test_depend_makes_the_later_batch_gate_the_earlier_one() -> None:
    """depend(a, b) forks a phony off ``a`` and joins it into ``b``: in backward, the fork on
    ``a`` (and so all of ``a``'s upstream) waits until ``b``'s gradient reached the join."""
    a = torch.ones(2, requires_grad=True) * 2
    b = torch.ones(2, requires_grad=True) * 3
    ba, bb = depend(Batch((a,)), Batch((b,)))
    fork_node = ba.values[0].grad_fn
    assert type(fork_node).__name__ == "_ForkBackward"
    assert _reaches(bb.values[0].grad_fn, fork_node)
    assert not _reaches(b.grad_fn, fork_node)
    (ba.values[0].sum() + bb.values[0].sum()).backward()  # still a valid graph


def test_depend_skips_batches_outside_autograd() -> None:
    x, y = torch.ones(2), torch.ones(2, requires_grad=True) * 1
    bx, by = depend(Batch((x,)), Batch((y,)))
    assert bx.values[0] is x and by.values[0] is y


def test_fork_join_are_identities_without_grad() -> None:
    x = torch.ones(2)
    y, phony = fork(x)
    assert y is x and phony.numel() == 0 and not phony.requires_grad
    assert join(x, phony) is x
    assert get_phony(torch.device("cpu"), requires_grad=True).requires_grad


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.used(x), self.unused(x)


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_output_the_loss_ignores_gets_no_gradient(mode: str) -> None:
    from executor import GPipe

    model = _TwoHeads()
    pipe = GPipe([model], ["cpu"], chunks=2, recompute=mode)
    used, _unused = pipe(torch.randn(4, 4))
    used.sum().backward()
    assert model.used.weight.grad is not None
    assert model.unused.weight.grad is None  # None, as without the pipeline; not zeros


def test_the_micro_batches_back_propagated_last_are_the_recomputed_ones() -> None:
    # [Note: which micro-batches recompute]: under torch's order (B0 first) except_last keeps
    # micro-batch 0 whole; executor.GPipe, draining B(M-1) first, keeps M-1 (its stop rule)
    from executor.spec import is_recomputed

    assert [i for i in range(4) if is_recomputed(i, 4, 3)] == [1, 2, 3]
    assert not any(is_recomputed(i, 4, 0) for i in range(4))
    assert all(is_recomputed(i, 4, 4) for i in range(4))
    assert recompute_stop("except_last", 4) == 3  # GPipe: micro-batches 0 .. 2



@pytest.mark.parametrize("recompute", ["always", "except_last"])
def test_checkpointed_steps_leave_no_tensor_behind(recompute: str) -> None:
    # The checkpoint's state once held a micro-batch's outputs while their grad_fn held the
    # state: a cycle through C++ autograd nodes that gc cannot collect, so every step leaked
    # each checkpointed stage's outputs (the U-Net example grew 15 MB a step).
    import gc

    from executor.local.gpipe import GPipe

    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 2))]
    pipe = GPipe(stages, ["cpu", "cpu"], chunks=4, recompute=recompute)
    x = torch.randn(16, 8)

    def live() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), Tensor))

    pipe(x).sum().backward()
    before = live()
    for _ in range(3):
        pipe(x).sum().backward()
    assert live() == before


class _ReturnsItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * 2, self.w.to(torch.float32)  # .to(its own dtype) returns the parameter itself


class _Scale(nn.Module):
    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return (x * w).sum(-1)


@pytest.mark.timeout(60, method="thread")  # it hung in C++, where a signal cannot end it
@pytest.mark.parametrize("recompute", ["always", "except_last"])
def test_a_checkpointed_stage_that_returns_a_parameter_leaves_it_a_leaf(recompute: str) -> None:
    # As the checkpoint's output the parameter itself got the checkpoint's grad_fn: it stopped
    # being a leaf, and the next step hung in backward.
    from executor.local.gpipe import GPipe

    first = _ReturnsItsWeight()
    pipe = GPipe([first, _Scale()], ["cpu", "cpu"], chunks=2, recompute=recompute)
    x = torch.randn(4, 3)
    for _ in range(2):
        first.w.grad = None
        pipe(x).sum().backward()
        assert first.w.is_leaf and first.w.grad_fn is None
    torch.testing.assert_close(first.w.grad, (x * 2).sum(0))
