"""[Note: recomputed layers] in the runtime: the same gradients, the predicted bytes kept."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.testing import assert_close

import autopipe
from autopipe.errors import BuildError
from autopipe.examples import get_example
from autopipe.frontend.building.stages import RecomputedLayer, recompute_alone
from executor.activation_meter import ActivationMeter


class Wide(nn.Module):
    """A residual block that saves far more than it reads: one layer when traced as a leaf."""

    def __init__(self, dim: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.b1, self.b2, self.b3 = Wide(), Wide(), Wide()

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.b3(self.b2(self.b1(self.inp(x)))))


SPLIT = [["inp", "b1", "b2"], ["b3", "out"]]


def _train(model: nn.Module, plan: autopipe.Plan, x: Tensor, y: Tensor,
           **trace: Any) -> tuple[autopipe.GPipe, list[int]]:
    """One training step of ``plan`` under the meter: the pipeline and each stage's counted peak."""
    pipe = autopipe.pipeline(model, (x,), plan=plan, devices=["cpu", "cpu"], **trace)
    meter = ActivationMeter(pipe.stages, inputs=(x,))
    with meter:
        out = pipe(x)
        with meter.outside():
            loss = F.mse_loss(out, y)
        loss.backward()
    return pipe, meter.peaks


def test_recomputed_layers_give_the_plain_models_gradients_and_keep_the_predicted_bytes() -> None:
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(32, 8), torch.randn(32, 4)
    reference = copy.deepcopy(model)
    prof = autopipe.profile(model, (x,), chunks=4, repeats=1, warmup=0, progress=False, leaf_modules=[Wide])
    on = dict(devices=["cpu", "cpu"], chunks=4, recompute="never")
    plain = autopipe.Plan.from_stages(prof, SPLIT, **on)
    plan = autopipe.Plan.from_stages(prof, SPLIT, **on, recompute_layers=["b1", "b3"])
    pipe, counted = _train(model, plan, x, y, leaf_modules=[Wide])
    assert sum(isinstance(m, RecomputedLayer) for m in pipe.modules()) == 2
    F.mse_loss(torch.cat([reference(c) for c in x.chunk(4)]), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)
    # the meter counts exactly what the plan predicts, and less than without recomputation
    assert counted == [b.activation_bytes for b in pipe.plan.breakdown]
    _, counted_plain = _train(copy.deepcopy(reference), plain, x, y, leaf_modules=[Wide])
    assert counted_plain == [b.activation_bytes for b in plain.breakdown]
    assert all(a < b for a, b in zip(counted, counted_plain, strict=True))


def test_a_pipeline_with_recomputed_layers_saves_and_loads_the_models_keys() -> None:
    # a segment's module holds the stage's own tensors: saved under the model's names only (it
    # also saved them as recomputed_0.layer.b1...., which the plain model refuses)
    torch.manual_seed(0)
    model, x = Net(), torch.randn(32, 8)
    prof = autopipe.profile(model, (x,), chunks=4, repeats=1, warmup=0, progress=False, leaf_modules=[Wide])
    plan = autopipe.Plan.from_stages(prof, SPLIT, devices=["cpu", "cpu"], chunks=4, recompute="never",
                                     recompute_layers=["b1", "b2", "b3"])
    pipe = autopipe.pipeline(model, (x,), plan=plan, devices=["cpu", "cpu"], leaf_modules=[Wide])
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    assert set(saved) == set(Net().state_dict())
    Net().load_state_dict(saved, strict=True)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    pipe.load_state_dict(saved)  # strict: nothing missing under the segments' names either
    for key, value in pipe.state_dict().items():
        assert_close(value, saved[key], msg=key)


def test_adjacent_segments_kept_apart_build_apart_and_keep_the_predicted_bytes() -> None:
    # b1 and b2 touch: segment_starts keeps them two checkpoints, each alive again alone
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(32, 8), torch.randn(32, 4)
    reference = copy.deepcopy(model)
    prof = autopipe.profile(model, (x,), chunks=4, repeats=1, warmup=0, progress=False, leaf_modules=[Wide])
    on = dict(devices=["cpu", "cpu"], chunks=4, recompute="never", recompute_layers=["b1", "b2"])
    merged = autopipe.Plan.from_stages(prof, SPLIT, **on)
    plan = autopipe.Plan.from_stages(prof, SPLIT, **on, segment_starts=["b2"])
    assert plan.breakdown[0].recompute_bytes < merged.breakdown[0].recompute_bytes
    pipe, counted = _train(model, plan, x, y, leaf_modules=[Wide])
    assert sum(isinstance(m, RecomputedLayer) for m in pipe.stages[0].modules()) == 2
    F.mse_loss(torch.cat([reference(c) for c in x.chunk(4)]), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)
    assert counted == [b.activation_bytes for b in pipe.plan.breakdown]
    one, counted_merged = _train(copy.deepcopy(reference), merged, x, y, leaf_modules=[Wide])
    assert sum(isinstance(m, RecomputedLayer) for m in one.stages[0].modules()) == 1
    assert counted_merged == [b.activation_bytes for b in merged.breakdown]
    assert counted[0] < counted_merged[0]


def test_consecutive_op_layers_recompute_as_one_segment() -> None:
    # traced op by op, fc1 -> gelu -> fc2 each saves what it reads: alone each frees nothing,
    # together they keep one copy of the block's input instead of its hidden activations
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(32, 8), torch.randn(32, 4)
    reference = copy.deepcopy(model)
    prof = autopipe.profile(model, (x,), chunks=4, repeats=1, warmup=0, progress=False)
    block = ["b2.fc1", "gelu_1", "b2.fc2"]
    assert set(block) <= set(prof.layers)
    cut = prof.layers.index("b2.fc2") + 1
    split = [prof.layers[:cut], prof.layers[cut:]]
    on = dict(devices=["cpu", "cpu"], chunks=4, recompute="never")
    plain = autopipe.Plan.from_stages(prof, split, **on)
    one = autopipe.Plan.from_stages(prof, split, **on, recompute_layers=block[1:2])
    assert one.breakdown[0].saved_bytes == plain.breakdown[0].saved_bytes  # gelu alone: nothing
    plan = autopipe.Plan.from_stages(prof, split, **on, recompute_layers=block)
    assert plan.breakdown[0].saved_bytes < plain.breakdown[0].saved_bytes
    pipe, counted = _train(model, plan, x, y)
    assert sum(isinstance(m, RecomputedLayer) for m in pipe.modules()) == 1
    assert counted == [b.activation_bytes for b in pipe.plan.breakdown]
    F.mse_loss(torch.cat([reference(c) for c in x.chunk(4)]), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)


def test_a_model_with_in_place_ops_recomputes_any_layer() -> None:
    # cnn: an in-place ReLU writes the output of a residual add; recomputing the layers around it
    # must not see the written values
    ex = get_example("cnn", batch_size=8)
    reference = copy.deepcopy(ex.model)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=2, repeats=1, warmup=0, progress=False)
    plan = autopipe.partition(prof, devices=["cpu", "cpu"], chunks=2, recompute="never", method="uniform")
    layers = [name for stage in plan.stages for name in stage][::2]  # one-layer segments, ops between
    plan = autopipe.Plan.from_stages(prof, plan.stages, devices=plan.devices, chunks=2, recompute="never",
                                     recompute_layers=layers)
    pipe = autopipe.pipeline(ex.model, ex.inputs, plan=plan, devices=["cpu", "cpu"])
    ex.loss_fn(pipe(*ex.inputs), ex.target).backward()
    pieces = zip(ex.inputs[0].chunk(2), ex.target.chunk(2), strict=True)
    (sum(ex.loss_fn(reference(x), t) for x, t in pieces) / 2).backward()
    for (name, p), q in zip(ex.model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)
    pipe.eval()
    with torch.no_grad():  # evaluation runs the layers once, nothing to recompute
        assert_close(pipe(*ex.inputs), reference.eval()(*ex.inputs))


class _ReadBetween(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        a = x + 1
        b = a * 2  # between the segment's two nodes, and reads the first
        return b + a


def test_a_segment_that_is_not_one_interval_is_refused_in_one_line() -> None:
    stage = fx.symbolic_trace(_ReadBetween())
    first, between, last = [n.name for n in stage.graph.nodes if n.op == "call_function"]
    with pytest.raises(BuildError, match=r"^layers add, add_1 cannot be recomputed as one segment \(.+\); "
                                         r"leave them out of the plan's recompute_layers$"):
        recompute_alone(stage, [first, last], "add, add_1")
    assert between == "mul"


def test_a_segment_fed_by_the_callers_batch_recomputes_as_the_profile_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # gpt's first layers read the token ids, which need no gradient: the reentrant checkpoint
    # (what the profile's recompute ratio measures) still reaches their parameters
    import autopipe.frontend.building.stages as stages

    ex = get_example("gpt", batch_size=4)
    reference = copy.deepcopy(ex.model)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=2, repeats=1, warmup=0, progress=False)
    split = autopipe.partition(prof, devices=["cpu", "cpu"], chunks=2, recompute="never", method="uniform")
    plan = autopipe.Plan.from_stages(prof, split.stages, devices=split.devices, chunks=2, recompute="never",
                                     recompute_layers=split.stages[0][:3])
    reentrant: list[bool] = []
    real = stages.checkpoint

    def recorded(fn: Any, *args: Any, use_reentrant: bool) -> Any:
        reentrant.append(use_reentrant)
        return real(fn, *args, use_reentrant=use_reentrant)

    monkeypatch.setattr(stages, "checkpoint", recorded)
    pipe = autopipe.pipeline(ex.model, ex.inputs, plan=plan, devices=["cpu", "cpu"])
    ex.loss_fn(pipe(*ex.inputs), ex.target).backward()
    assert reentrant and all(reentrant)
    pieces = zip(ex.inputs[0].chunk(2), ex.target.chunk(2), strict=True)
    (sum(ex.loss_fn(reference(x), t) for x, t in pieces) / 2).backward()
    for (name, p), q in zip(ex.model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad, msg=name)
