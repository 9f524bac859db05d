"""autopipe.distributed_pipeline on 2 gloo ranks: other sequence lengths, eval_step, train/eval.

Ranks are spawned with tests/assemble/test_ranks.py's helpers. References are the plain model
on the same micro-batches (see [Note: loss of a pipeline] in autopipe/assemble/ranks.py).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe import BuildError, TraceError
from autopipe.assemble.ranks import distributed_pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from executor.ranks.distributed import DistributedError, DistributedPipeline
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import _ok, one_rank, spawn  # noqa: F401 - a fixture
from tests.frontend.tracing.test_dynamic_shapes import FixedView, hf_model
from tests.frontend.tracing.test_modes import TrainOnlyBranch, gpt2_with_dropout

CHUNKS = 2
LENGTHS = (5, 12)  # the pipelines are built on length 8


def lm_loss(out: Any, y: Tensor) -> Tensor:
    if hasattr(out, "logits"):
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))
    return out.last_hidden_state.pow(2).mean() + 0 * y.sum()  # BERT: no head, target unused


def ids(batch: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def build(model: nn.Module, example: Tensor, stages: int = 2, loss_fn: Any = lm_loss,
          **kwargs: Any) -> tuple[DistributedPipeline, dict[str, Any]]:
    """This rank's pipeline of ``model`` on a plan of ``stages`` (one per rank) from made-up
    costs, and that plan's stages.

    Each rank traces once: the graph it plans with is the one it builds with (``graph=``), and
    made-up costs give both ranks the same plan (the tests compare its stages) without
    profiling: what these tests run does not depend on the plan's predicted times."""
    graph = trace(model, microbatch_inputs((example,), CHUNKS))
    plan = partition(cost_profile(graph), stages=stages, method="dp", chunks=CHUNKS)
    pipe = distributed_pipeline(model, (example,), loss_fn=loss_fn, plan=plan, chunks=CHUNKS,
                                timeout=30, graph=graph, **kwargs)
    return pipe, {"stages": plan.stages, "fingerprint": plan.fingerprint}


def reference_step(model: nn.Module, x: Tensor, y: Tensor, chunks: int = CHUNKS) -> Tensor:
    loss = torch.stack([lm_loss(model(xi), yi) for xi, yi in
                        zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True)]).mean()
    loss.backward()
    return loss.detach()


def grads(pipe: DistributedPipeline) -> dict[str, Tensor | None]:
    return {name: p.grad for name, p in pipe.stage_module.named_parameters()}


def assert_grads_match(values: list[dict[str, Any]], key: Any, model: nn.Module) -> None:
    covered = set()
    for v in values:
        for name, grad in v[key]["grads"].items():
            want = model.get_parameter(name).grad
            if want is None:
                assert grad is None, name
                continue
            assert_close(grad, want, msg=lambda m, name=name: f"{key} {name}: {m}")
            covered.add(id(model.get_parameter(name)))  # a tied weight may have two names
    assert covered == {id(p) for p in model.parameters() if p.grad is not None}


# --- other lengths -------------------------------------------------------------------------------
def _lengths(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("gpt2", "llama", "bert"):
            pipe, out[(name, "plan")] = build(hf_model(name), ids(4, 8, 0), schedule="1f1b")
            for length in LENGTHS:
                for p in pipe.stage_module.parameters():
                    p.grad = None
                loss = pipe.step(ids(4, length, length), target=ids(4, length, length + 1))
                out[(name, length)] = {"loss": loss, "grads": grads(pipe)}
    pipe, _ = build(FixedView(), torch.randn(4, 16, 8), loss_fn=F.mse_loss)
    try:
        pipe.step(torch.randn(4, 12, 8), target=torch.randn(4, 4))
    except DistributedError as err:
        out["fixed"] = str(err)
    out["after"] = pipe.step(torch.randn(4, 16, 8), target=torch.randn(4, 4))  # still usable
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_run_other_lengths_like_one_process() -> None:
    values = _ok(spawn(_lengths, timeout=170))
    for name in ("gpt2", "llama", "bert"):
        assert values[0][(name, "plan")] == values[1][(name, "plan")]
        model = hf_model(name)
        for length in LENGTHS:
            model.zero_grad(set_to_none=True)
            want = reference_step(model, ids(4, length, length), ids(4, length, length + 1))
            assert values[0][(name, length)]["loss"] is None
            assert_close(values[1][(name, length)]["loss"], want)
            assert_grads_match(values, (name, length), model)
    # rank 0 names the input; rank 1 stops too, at once, instead of waiting for the timeout
    assert values[0]["fixed"] == ("dimension 1 of input 'x' is 12, but the pipeline runs 16 there: "
                                  "its stages fix it; pass inputs with 16 in dimension 1")
    assert values[1]["fixed"] == ("rank 0 refused this step's inputs (its error says why); every "
                                  "rank stops the step")
    assert values[1]["after"] is not None


# --- eval_step, train() and eval() -----------------------------------------------------------
def _modes(rank: int) -> dict[str, Any]:
    x, y = ids(4, 8, 1), ids(4, 8, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, plan = build(gpt2_with_dropout(), ids(4, 8, 0))
        out: dict[str, Any] = {"plan": plan, "outputs": [pipe.eval_step(x) for _ in range(2)],
                               "eval_loss": pipe.eval_step(x, target=y),
                               "training_after_eval_step": pipe.training}
        pipe.eval()
        out["eval_step_in_eval_mode"] = {"loss": pipe.step(x, target=y), "grads": grads(pipe)}
        pipe.train()
        train = []
        for _ in range(2):
            torch.manual_seed(3)  # every rank: the same draws in both steps
            for p in pipe.stage_module.parameters():
                p.grad = None
            train.append(pipe.step(x, target=y))
        out["train_losses"] = train
        out["longer"] = pipe.eval_step(ids(4, 11, 3))  # eval at another length, too
    return out


@pytest.mark.timeout(120)
def test_two_ranks_eval_step_and_modes_match_the_model() -> None:
    values = _ok(spawn(_modes, timeout=110))
    assert values[0]["plan"] == values[1]["plan"]
    model = gpt2_with_dropout().eval()
    x, y = ids(4, 8, 1), ids(4, 8, 2)
    with torch.no_grad():
        expected = model(x).logits
        expected_loss = torch.stack([lm_loss(model(xi), yi) for xi, yi in
                                     zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True)]).mean()
        longer = model(ids(4, 11, 3)).logits
    first, second = values[1]["outputs"]
    assert values[0]["outputs"] == [None, None]
    assert_close(first.logits, expected)  # dropout off, outputs of the whole batch
    assert torch.equal(first.logits, second.logits)
    assert_close(values[1]["eval_loss"], expected_loss)
    assert_close(values[1]["longer"].logits, longer)
    assert [v["training_after_eval_step"] for v in values] == [True, True]  # put back

    reference = copy.deepcopy(model)  # pipe.eval(); pipe.step(...): a training step in eval mode
    want = reference_step(reference, x, y)
    assert_close(values[1]["eval_step_in_eval_mode"]["loss"], want)
    assert_grads_match(values, "eval_step_in_eval_mode", reference)

    # Back in train mode dropout acts again: the loss moves off the eval-mode loss, and the same
    # seed on every rank repeats it. It is not the plain model's train-mode loss for that seed:
    # each rank draws its masks from its own generator, the single process from one.
    a, b = values[1]["train_losses"]
    assert torch.equal(a, b)
    assert not torch.allclose(a, want)


class ScalarOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.proj(x)
        return h, h.pow(2).mean()


@pytest.mark.slow
@pytest.mark.usefixtures("one_rank")
def test_eval_step_on_one_rank() -> None:
    model = gpt2_with_dropout()
    reference = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe, _ = build(model, ids(4, 8, 0), stages=1)
        assert pipe.training and pipe.eval() is pipe and not pipe.training
        pipe.train()
        out = pipe.eval_step(ids(4, 6, 1))
    with torch.no_grad():
        assert_close(out.logits, reference(ids(4, 6, 1)).logits)
    assert pipe.training
    scalar_model = ScalarOut()
    with torch.no_grad():
        h, mean = copy.deepcopy(scalar_model)(x := torch.randn(4, 4))
    scalar, _ = build(scalar_model, torch.randn(4, 4), stages=1, loss_fn=lambda o, y: o[1])
    out = scalar.eval_step(x)  # a 0-dim leaf is weighted by rows, as executor.GPipe gathers it
    assert_close(out[0], h)
    assert_close(out[1], mean)
    assert_close(scalar.eval_step(x, target=torch.zeros(4)), mean)
    branch = TrainOnlyBranch()  # one graph cannot hold both modes: eval is refused in one line
    one_mode, _ = build(branch, torch.randn(4, 4), stages=1, loss_fn=F.mse_loss)
    one_mode.step(torch.randn(4, 4), target=torch.randn(4, 4))
    with pytest.raises(TraceError, match=r"^this pipeline can only run in train mode: the model "
                                         r"runs 'mul' in train mode only"):
        one_mode.eval_step(torch.randn(4, 4))
    assert one_mode.training


@pytest.mark.usefixtures("one_rank")
def test_a_graph_is_used_as_given_and_one_of_another_model_or_shape_is_refused() -> None:
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    model = mlp()
    graph = trace(model, microbatch_inputs((x,), CHUNKS))
    pipe = distributed_pipeline(model, (x,), loss_fn=F.mse_loss, chunks=CHUNKS, method="uniform",
                                graph=graph)
    reference = mlp()
    want = torch.stack([F.mse_loss(reference(xi), yi) for xi, yi in
                        zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True)]).mean()
    want.backward()
    assert_close(pipe.step(x, target=y), want)
    assert_close(grads(pipe), {n: p.grad for n, p in reference.named_parameters()})
    model = mlp()
    with pytest.raises(BuildError, match=r"^graph= was traced from another model \(its parameter "
                                         r"'0.weight' is not this model's\): pass autopipe.trace\(model"):
        distributed_pipeline(model, (x,), loss_fn=F.mse_loss, chunks=CHUNKS, graph=graph)
    whole = trace(model, (x,))  # the mini-batch, not its micro-batch
    with pytest.raises(BuildError, match=r"^graph= was traced on inputs \(\(4, 4\), torch.float32\), but "
                                         r"the micro-batch here is \(\(2, 4\), torch.float32\): trace"):
        distributed_pipeline(model, (x,), loss_fn=F.mse_loss, chunks=CHUNKS, graph=whole)
    wide = trace(model, microbatch_inputs((x,), CHUNKS))
    with pytest.raises(BuildError, match=r"^graph= was traced on inputs.*torch.float64\): trace"):
        distributed_pipeline(model, (x.double(),), loss_fn=F.mse_loss, chunks=CHUNKS, graph=wide)
