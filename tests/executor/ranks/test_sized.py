"""[Note: one schedule per input size]: stages sized as a real run at each size, built once."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from executor.errors import DistributedError
from executor.ranks import sized
from executor.ranks.messages import pack
from executor.ranks.sized import SizedSchedules, _input_names, microbatch_sizes_of
from executor.ranks.torch_schedules import build_schedule, schedule_class
from executor.ranks.wire import Wire, WireStage, _encode, infer_wires, input_sizes, slots
from executor.spec import is_recomputed

CPU = torch.device("cpu")


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[Any, ...]:
        return self.a(x), self.b(x), x.size(1), x[..., 0] > 0, None


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, r: torch.Tensor, n: int, mask: torch.Tensor, none: None) -> torch.Tensor:
        return (self.c(h + r) * mask.unsqueeze(-1)).sum(1) / n


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    """A process group of this process alone (what PipelineStage and agree() ask for)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class Built:
    """Every make_schedule call: the stages and the input/output metas each was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[Any]] = []
        self.metas: dict[int, tuple[Any, Any]] = {}
        self.builders: dict[int, Any] = {}
        init = sized._Stage.__init__

        def recording(stage: Any, submodule: Any, wire: Any, recomputed: Any, index: int, *args: Any,
                      **kwargs: Any) -> None:
            self.metas[index] = (kwargs["input_args"], kwargs["output_args"])
            self.builders[index] = kwargs["dw_builder"]
            init(stage, submodule, wire, recomputed, index, *args, **kwargs)

        monkeypatch.setattr(sized._Stage, "__init__", recording)

    def __call__(self, stages: list[Any]) -> object:
        self.calls.append(stages)
        return object()  # a schedule: one distinct object per build


def _pipeline(group: dist.ProcessGroup, built: Built, *, split: bool = False,
              recomputed: tuple[int, int] = (0, 0)) -> tuple[SizedSchedules, list[WireStage], list[nn.Module]]:
    stages: list[nn.Module] = [First(), Last()]
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    wire_stages = [WireStage(s, wires[i], wires[i + 1], first=i == 0, last=i == 1, device=CPU, split=split)
                   for i, s in enumerate(stages)]
    schedules = SizedSchedules(wire_stages, [0, 1], 2, wires, built, recomputed=recomputed, chunks=2,
                               device=CPU, group=group)
    return schedules, wire_stages, stages


def _metas(tensors: Any) -> list[tuple[Any, ...]]:
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]


def test_microbatch_sizes_are_those_of_one_chunk() -> None:
    x, scalar = torch.randn(6, 3, 4), torch.tensor(5)
    sizes = microbatch_sizes_of((x, scalar, 7, None), 3)
    assert sizes == (tuple(x.chunk(3)[0].shape), (), None, None)
    assert sizes == input_sizes((x.chunk(3)[0], scalar, 7, None))


def test_input_names_are_stage_zeros_positional_parameters() -> None:
    class Stage(nn.Module):
        def forward(self, x: Any, mask: Any, /, *rest: Any, flag: bool = False) -> Any:
            return x

    assert _input_names(Stage()) == ["x", "mask"]
    assert _input_names(First()) == ["x"]


def test_each_size_gets_stages_sized_as_a_real_run_at_that_size(group: dist.ProcessGroup,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    schedules, wire_stages, stages = _pipeline(group, built)
    assert len(built.calls) == 1 and schedules.example == ((2, 3, 4),)  # the example's, built up front
    y = torch.randn(5, 7, 4)
    schedules.get(input_sizes((y,)))
    assert len(built.calls) == 2
    assert [s.stage_index for s in built.calls[-1]] == [0, 1]
    # the truth: a plain run at that size, its cut packed as the wire stages send it
    values = stages[0](y)
    real = tuple(Wire.of(v) for v in values)
    messages = pack(_encode(values, real, CPU), slots(real))
    (inputs0, outputs0), (inputs1, outputs1) = built.metas[0], built.metas[1]
    assert _metas(inputs0) == _metas([y])
    assert _metas(outputs0) == _metas(inputs1) == _metas(messages)
    assert _metas(outputs1) == _metas([stages[1](*values)])
    assert len(messages) == 2  # h and r in one message, the rest in bytes: a real packing
    # the wire stages now pack for that size: the chain runs it, as the plain stages do
    received = [m.detach().clone().requires_grad_(m.requires_grad) for m in wire_stages[0](y)]
    (out,) = wire_stages[1](*received)
    assert torch.equal(out, stages[1](*values))
    assert built.builders == {0: None, 1: None}  # no split: torch's own weight step


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "interleaved_zb"])
def test_the_schedule_for_another_size_steps_as_the_plain_model(group: dist.ProcessGroup, schedule: str) -> None:
    """Both stages on this one rank, each backward split under the zero-bubble schedule: a step
    at a size other than the example's gives the plain model's losses and gradients."""
    stages: list[nn.Module] = [First(), Last()]
    ref = copy.deepcopy(stages)
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    wire_stages = [WireStage(s, wires[i], wires[i + 1], first=i == 0, last=i == 1, device=CPU,
                             split=schedule == "interleaved_zb") for i, s in enumerate(stages)]

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        return (wire_stages[1].unflatten(out) - target).square().mean()

    kind = schedule_class(schedule)
    schedules = SizedSchedules(wire_stages, [0, 1], 2, wires,
                               lambda built: build_schedule(kind, schedule, built, 2, loss),
                               recomputed=[0, 0], chunks=2, device=CPU, group=group)
    x, y = torch.randn(4, 6, 4), torch.randn(4, 2)
    losses: list[torch.Tensor] = []
    schedules.get(schedules.agree(microbatch_sizes_of((x,), 2), "")).step(x, target=y, losses=losses)
    want = [(ref[1](*ref[0](xc)) - yc).square().mean() for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True)]
    assert_close(torch.stack([t.detach() for t in losses]), torch.stack(want).detach())
    sum(want).backward()  # the schedule leaves the gradients unscaled: the micro-batches' sum
    for s, r in zip(stages, ref, strict=True):
        for (name, p), q in zip(s.named_parameters(), r.parameters(), strict=True):
            assert_close(p.grad, q.grad, msg=name)


def test_a_split_stage_gives_torch_its_weight_step(group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    _, wire_stages, _ = _pipeline(group, built, split=True)
    for index, w in enumerate(wire_stages):
        assert w.weight_grads is not None
        assert built.builders[index] == w.weight_grads.builder


def test_a_size_is_built_once_and_only_the_last_few_used_are_kept(group: dist.ProcessGroup,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    schedules, _, _ = _pipeline(group, built)
    first = schedules.get(schedules.example)
    assert len(built.calls) == 1 and schedules.get(schedules.example) is first
    others = [((2, t, 4),) for t in range(4, 4 + sized._KEEP)]
    got = [schedules.get(s) for s in others[:-1]]  # _KEEP sizes now, the example the oldest
    assert len(built.calls) == sized._KEEP
    assert schedules.get(schedules.example) is first  # used again: now the newest
    schedules.get(others[-1])  # one too many: the least recently used goes
    assert len(built.calls) == 1 + sized._KEEP
    assert schedules.get(schedules.example) is first and len(built.calls) == 1 + sized._KEEP
    again = schedules.get(others[0])  # dropped: built anew
    assert again is not got[0] and len(built.calls) == 2 + sized._KEEP


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum(1)  # (batch, 4): dimension 1 of the input is gone


def test_sizes_the_cuts_cannot_take_are_refused_in_one_line(group: dist.ProcessGroup,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # a rank holding the last stage only: its own cuts need the batch size alone, but cut 0 (the
    # model's inputs, a 3-d tensor) cannot be sized from a 1-d size
    stages = [Pool(), nn.Linear(4, 2)]
    wires = infer_wires(stages, (torch.randn(2, 3, 4),))
    last = WireStage(stages[1], wires[1], wires[2], first=False, last=True, device=CPU)
    schedules = SizedSchedules([last], [1], 2, wires, Built(monkeypatch), recomputed=[0], chunks=2,
                               device=CPU, group=group)
    assert schedules.get(((5, 3, 4),)) is not None
    with pytest.raises(DistributedError, match=r"^cannot size the pipeline's cuts for inputs \[\(5,\)\]: "
                                               r"size in0_1 depends on .*; pass inputs shaped like the example$"):
        schedules.get(((5,),))


def test_sizes_this_ranks_own_cuts_cannot_take_are_refused_in_one_line(
        group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    schedules, _, _ = _pipeline(group, Built(monkeypatch))
    with pytest.raises(DistributedError, match=r"^cannot size the pipeline's cuts for inputs \[None\]"):
        schedules.get((None,))


def test_agree_on_one_rank_returns_the_sizes_or_refuses_them(group: dist.ProcessGroup,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    schedules, _, _ = _pipeline(group, Built(monkeypatch))
    assert schedules.agree(((6, 9, 4),), "") == ((6, 9, 4),)
    with pytest.raises(DistributedError, match="^no inputs were given$"):
        schedules.agree(None, "")
    with pytest.raises(DistributedError, match="^the batch is odd$"):
        schedules.agree(((6, 9, 4),), "the batch is odd")
    with pytest.raises(DistributedError, match="^dimension 2 of input 'x' is 5, but the pipeline runs 4 there"):
        schedules.agree(((6, 9, 5),), "")


def _defining(name: str) -> type:
    from torch.distributed.pipelining import PipelineStage

    return next(c for c in PipelineStage.__mro__ if name in vars(c))


def test_a_stage_marks_its_recomputed_micro_batches_and_whole_backwards_while_it_runs_them(
        group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    built = Built(monkeypatch)
    _, wire_stages, _ = _pipeline(group, built, split=True, recomputed=(1, 0))
    seen: list[tuple[str, int, bool]] = []

    def forward(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> None:
        seen.append(("F", chunk, stage._wire.recompute))

    def backward(stage: Any, chunk: int, loss: Any = None, full_backward: bool = True,
                 last_backward: bool = False) -> None:
        seen.append(("B", chunk, stage._wire.weight_grads.whole))

    monkeypatch.setattr(_defining("forward_one_chunk"), "forward_one_chunk", forward)
    monkeypatch.setattr(_defining("backward_one_chunk"), "backward_one_chunk", backward)
    stage0, stage1 = built.calls[-1]
    for chunk in range(2):
        stage0.forward_one_chunk(chunk)
        stage1.forward_one_chunk(chunk)
    stage0.backward_one_chunk(0, full_backward=True)
    stage0.backward_one_chunk(1, full_backward=False)
    assert seen == [("F", 0, is_recomputed(0, 2, 1)), ("F", 0, False), ("F", 1, is_recomputed(1, 2, 1)),
                    ("F", 1, False), ("B", 0, True), ("B", 1, False)]
    assert [w.recompute for w in wire_stages] == [False, False]  # only while it runs
    assert [w.weight_grads.whole for w in wire_stages if w.weight_grads] == [False, False]
