"""pipe.train() / pipe.eval() behave as the model's do ([Note: train and eval in one graph]).

Dropout is on (p = 0.1 in GPT-2, 0.5 in the small models) so that a mode baked into the graph
shows: in eval mode outputs must equal ``model.eval()``'s and repeat exactly; back in train
mode dropout must act again.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe import TraceError
from autopipe.assemble.local import Pipeline, pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.frontend.tracing.capture import capture
from autopipe.frontend.tracing.graph import trace
from autopipe.solvers.partitioner import partition
from tests.assemble.test_local import cost_profile


def gpt2_with_dropout() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))


def build(model: nn.Module, inputs: tuple[Tensor, ...], chunks: int, stages: int = 2) -> Pipeline:
    graph = trace(model, microbatch_inputs(inputs, chunks))
    plan = partition(cost_profile(graph), stages=stages, method="dp", chunks=chunks,
                     devices=["cpu"] * stages)
    return pipeline(model, inputs, devices=["cpu"] * stages, chunks=chunks, plan=plan, graph=graph)


def logits(out: object) -> Tensor:
    return out.logits if hasattr(out, "logits") else out  # type: ignore[return-value]


@pytest.mark.parametrize("chunks", [1, 2])
def test_gpt2_eval_and_train_match_the_model(chunks: int) -> None:
    model = gpt2_with_dropout()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = build(model, (ids,), chunks)
    assert pipe.graph.source == "export"

    pipe.eval()
    reference.eval()
    with torch.no_grad():
        expected = reference(ids).logits
        first, second = logits(pipe(ids)), logits(pipe(ids))
    assert_close(first, expected)
    assert torch.equal(first, second)  # no dropout left anywhere in the graph

    pipe.train()
    reference.train()
    torch.manual_seed(7)
    out = logits(pipe(ids))
    assert not torch.allclose(out, expected)  # dropout acts again
    if chunks == 1:
        # One micro-batch through stages on one device runs inline, op for op in the model's
        # order, so the dropout masks come from the same draws of the same generator: the
        # pipeline's train-mode forward and gradients are the model's. (With 2 micro-batches the
        # draws are split into per-micro-batch masks: equal in distribution, not in value.)
        torch.manual_seed(7)
        want = reference(ids).logits
        assert_close(out, want)
        out.logsumexp(-1).mean().backward()
        want.logsumexp(-1).mean().backward()
        ref = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            assert_close(p.grad, ref[name].grad, msg=lambda m, name=name: f"{name}: {m}")


class FunctionalDropout(nn.Module):
    """torch.fx bakes F.dropout's training=self.training; nn.Dropout stays a module call."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(F.relu(self.a(x)), p=0.5, training=self.training)
        return self.c(self.drop(F.relu(self.b(h))))


def test_fx_functional_dropout_follows_the_mode() -> None:
    model = FunctionalDropout()
    x = torch.randn(8, 16)
    cap = capture(model, (x,))
    assert cap.source == "fx" and cap.modes.selected == 1 and not cap.modes.one_mode
    pipe = build(model, (x,), chunks=2)
    pipe.eval()
    expected = copy.deepcopy(model).eval()(x)
    assert_close(pipe(x), expected)
    assert_close(pipe(x), expected)
    pipe.train()
    assert not torch.allclose(pipe(x), expected)


class BatchNormNet(nn.Module):
    """BatchNorm through torch.export (int(size) stops torch.fx): training, momentum and
    num_batches_tracked.add_(1) are baked per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3)).reshape(-1, int(h.shape[1])))


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_export_batchnorm_uses_running_statistics_in_eval(traced_in: str) -> None:
    model = BatchNormNet()
    model.train(traced_in == "train")
    x = torch.randn(4, 3, 8, 8)
    cap = capture(model, (x,))
    assert cap.source == "export" and not cap.modes.one_mode and cap.modes.guarded == 1
    assert int(model.bn.num_batches_tracked) == 0  # tracing leaves the model's state alone
    reference = copy.deepcopy(model)
    pipe = build(model, (x,), chunks=1)
    pipe.train()
    reference.train()
    assert_close(pipe(x), reference(x))  # batch statistics, and the running ones updated
    assert int(model.bn.num_batches_tracked) == int(reference.bn.num_batches_tracked) == 1
    assert_close(model.bn.running_mean, reference.bn.running_mean)
    pipe.eval()
    reference.eval()
    assert_close(pipe(x), reference(x))  # running statistics, nothing updated
    assert int(model.bn.num_batches_tracked) == 1


class TrainOnlyBranch(nn.Module):
    """``if self.training`` runs another op: one graph cannot serve both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if self.training:
            h = h * 2.0
        return self.b(h)


def test_a_mode_the_graph_cannot_hold_is_refused_in_one_line() -> None:
    model = TrainOnlyBranch()
    x = torch.randn(4, 4)
    pipe = build(model, (x,), chunks=2)
    reference = copy.deepcopy(model)
    assert_close(pipe(x), reference(x))
    pipe.eval()
    with pytest.raises(TraceError) as info:
        pipe(x)
    line = TrainOnlyBranch.forward.__code__.co_firstlineno + 3
    assert str(info.value) == (
        "this pipeline can only run in train mode: the model runs 'mul' in train mode only "
        f"(at tests/frontend/tracing/test_modes.py:{line}), a path the traced graph cannot switch; "
        "build another pipeline from the model in eval mode (model.eval() before "
        "autopipe.pipeline / autopipe.trace) for that"
    )
    pipe.train()
    assert_close(pipe(x), reference(x))


def test_a_slice_bounded_by_a_traced_size_serves_both_modes() -> None:
    # TinyGPT reads ``self.pos[:, : ids.shape[1]]``: in each mode's graph the slice's bound is
    # that graph's own node, so the graphs must be compared through the slice
    from autopipe.examples import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(layers=2, dropout=0.5)
    ids = torch.randint(0, 256, (4, 16))
    pipe = build(model, (ids,), chunks=2)
    pipe.eval()
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert_close(pipe(ids), ref(ids))
