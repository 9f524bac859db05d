from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pandas as pd
import pytest
import torch
from torch import fx, nn

from autopipe import BuildError, PlanError
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.examples import get_example
from autopipe.frontend.building.stages import build, split_stages, stage_boundaries
from autopipe.frontend.tracing.graph import LayerGraph, trace
from tests.models import MultiIO, Skip, tiny_gpt2


def run_chain(stages: Sequence[nn.Module], inputs: tuple[Any, ...]) -> Any:
    out = stages[0](*inputs)
    for stage in stages[1:]:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    return out


def even(layers: list[str], k: int) -> list[list[str]]:
    bounds = [round(i * len(layers) / k) for i in range(k + 1)]
    return [layers[bounds[i] : bounds[i + 1]] for i in range(k)]


def plan_for(graph: LayerGraph, stages: list[list[str]], fingerprint: str | None = None, chunks: int = 2,
             recompute: str = "except_last", devices: Sequence[str] | None = None) -> Plan:
    df = pd.DataFrame(
        {
            "layer": graph.layers,
            "fwd_ms": 1.0,
            "bwd_ms": 2.0,
            "param_bytes": [graph.nx.nodes[n]["param_bytes"] for n in graph.layers],
            "output_bytes": [graph.nx.nodes[n]["output_bytes"] for n in graph.layers],
            "saved_bytes": 0,
        }
    )
    meta = {"fingerprint": fingerprint or graph.fingerprint}
    profile = Profile.from_frame(df, edges=graph.edges(), meta=meta)
    return Plan.from_stages(profile, stages, chunks=chunks, recompute=recompute, devices=devices)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "unet"])
def test_stages_compose_to_the_model(name: str) -> None:
    ex = get_example(name, batch_size=4)
    graph = trace(ex.model, ex.inputs)
    expected = ex.model(*ex.inputs)
    for k in (1, 2, 3, 4):
        stages = split_stages(graph, even(graph.layers, k))
        assert len(stages) == k
        torch.testing.assert_close(run_chain(stages, ex.inputs), expected)
        # micro-batches of another size run through the same stages
        torch.testing.assert_close(
            run_chain(stages, tuple(x[:3] for x in ex.inputs)), ex.model(*(x[:3] for x in ex.inputs))
        )


def test_skip_connection_is_passed_through_the_middle_stage() -> None:
    model = Skip()
    graph = trace(model, (torch.randn(4, 8),))
    stages_spec = [["a"], ["b", "relu"], ["c", "add", "d"]]
    _, live = stage_boundaries(graph, stages_spec)
    assert live == [["x"], ["a"], ["a", "relu"]]  # h = a(x) crosses both cuts
    stages = split_stages(graph, stages_spec)
    h = stages[0](torch.randn(4, 8))
    assert isinstance(h, tuple) and len(h) == 1
    middle = stages[1](*h)
    assert len(middle) == 2 and middle[0] is h[0]  # passed through unchanged


def test_parameters_are_the_models_own_under_original_keys() -> None:
    ex = get_example("gpt", batch_size=2)
    graph = trace(ex.model, ex.inputs)
    stages = split_stages(graph, even(graph.layers, 3))
    keys = [k for s in stages for k in s.state_dict()]
    assert set(keys) == set(ex.model.state_dict())
    assert stages[0].get_parameter("tok.weight") is ex.model.tok.weight
    # the tied head uses the very same Parameter object in the last stage
    assert stages[-1].get_parameter("head.weight") is stages[0].get_parameter("tok.weight")


def test_gradients_flow_through_stages() -> None:
    ex = get_example("unet", batch_size=2)
    graph = trace(ex.model, ex.inputs)
    stages = split_stages(graph, even(graph.layers, 3))
    ex.loss_fn(run_chain(stages, ex.inputs), ex.target).backward()
    grads = {n: p.grad.clone() for n, p in ex.model.named_parameters() if p.grad is not None}
    ex.model.zero_grad()
    ex.loss_fn(ex.model(*ex.inputs), ex.target).backward()
    assert set(grads) == {n for n, _ in ex.model.named_parameters()}
    for n, p in ex.model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)


def test_dict_output_and_two_inputs() -> None:
    model = MultiIO()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    graph = trace(model, (x, y))
    stages = split_stages(graph, [["x_proj"], ["y_proj", "add"], ["out"]])
    out = run_chain(stages, (x, y))
    torch.testing.assert_close(out["logits"], model(x, y)["logits"])


def test_huggingface_gpt2_stages_return_model_output() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, (ids,))
    stages = split_stages(graph, even(graph.layers, 3))
    out = run_chain(stages, (ids[:3],))
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    torch.testing.assert_close(out.logits, model(ids[:3]).logits)


def test_build_checks_the_plan() -> None:
    ex = get_example("mlp", batch_size=4)
    graph = trace(ex.model, ex.inputs)
    stages = build(ex.model, plan_for(graph, even(graph.layers, 2)), graph)
    assert len(stages) == 2
    with pytest.raises(PlanError, match="fingerprint"):
        build(ex.model, plan_for(graph, even(graph.layers, 2), "0123456789abcdef"), graph)
    other = get_example("mlp", batch_size=4)
    with pytest.raises(BuildError, match="not the model's own"):
        build(other.model, plan_for(graph, even(graph.layers, 2)), graph)


@pytest.mark.parametrize(
    "spec,match",
    [
        ([], "at least one stage"),
        ([["net.0"], []], "stage 1 of 2 is empty"),
        ([["net.0", "net.0"]], "is in stage 0 and stage 0"),
        ([["net.0"]], "leaves 14 layer.s. of the traced model unassigned"),
        ([["nope"]], "names 1 layer.s. not in the traced model"),
    ],
)
def test_bad_stage_lists(spec: list[list[str]], match: str) -> None:
    graph = trace(get_example("mlp", 2).model, get_example("mlp", 2).inputs)
    with pytest.raises(BuildError, match=match):
        split_stages(graph, spec)


def test_stages_out_of_order() -> None:
    graph = trace(get_example("mlp", 2).model, get_example("mlp", 2).inputs)
    layers = graph.layers
    with pytest.raises(BuildError, match="runs backwards"):
        split_stages(graph, [layers[5:], layers[:5]])


class _WritesItsInput(nn.Module):
    """Each cut before a ReLU/add gives the next stage an input it writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))  # a module with inplace=True
        h = self.b(h).relu_()  # an in-place method
        return self.c(h).add_(1.0) * 2.0  # an in-place method with an argument


class _WritesThroughViews(nn.Module):
    """A stage's graph that writes its input through a view of a view."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.t()[:2].mul_(3.0)  # two features of every row
        return h * 2.0


def test_a_write_through_a_view_of_an_input_gets_the_input_copied() -> None:
    # a received input is a leaf that needs a gradient: written through a view without the copy,
    # autograd refuses ("a view of a leaf Variable that requires grad is being used in an
    # in-place operation"); with it, the gradient is the whole model's
    from autopipe.frontend.building.stages import _copy_written_inputs

    stage = fx.symbolic_trace(_WritesThroughViews())
    _copy_written_inputs(stage)
    assert sum(n.op == "call_method" and n.target == "clone" for n in stage.graph.nodes) == 1
    received = torch.randn(4, 8, requires_grad=True)
    out = stage(received)
    expected = received.detach().clone()
    expected[:, :2] *= 3.0
    torch.testing.assert_close(out, expected * 2.0)
    out.sum().backward()
    grad = torch.full((4, 8), 2.0)
    grad[:, :2] *= 3.0
    torch.testing.assert_close(received.grad, grad)


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_a_stage_that_writes_its_input_in_place_gets_a_copy_and_the_models_gradients(mode: str) -> None:
    import copy

    import autopipe

    model = _WritesItsInput()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 8)
    graph = trace(model, (x[:2],))
    # every stage after the first starts with the op that writes what it received
    starts = [graph.layers.index(name) for name in ("act", "relu_", "add_")]
    stages = [graph.layers[i:j] for i, j in zip([0, *starts], [*starts, len(graph.layers)], strict=True)]
    plan = plan_for(graph, stages, chunks=4, recompute=mode, devices=["cpu"] * 4)
    built = build(model, plan, graph)
    assert [sum(n.op == "call_method" and n.target == "clone" for n in s.graph.nodes) for s in built] == [0, 1, 1, 1]
    plain(x).sum().backward()
    pipe = autopipe.pipeline(model, (x,), devices=["cpu"] * 4, chunks=4, recompute=mode, graph=graph,
                             plan=plan)
    pipe(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
