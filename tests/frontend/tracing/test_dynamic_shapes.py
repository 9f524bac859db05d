"""A pipeline traced at one sequence length runs others ([Note: dynamic sizes]), in one process.

Gradients are compared with a deep copy of the model run on the same inputs; the plan comes
from made-up costs (tests/assemble/test_local.py), which is enough to cut the graph into stages.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe import TraceError
from autopipe.assemble.local import Pipeline, pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.frontend.tracing.graph import trace
from autopipe.frontend.tracing.shapes import check_inputs
from autopipe.solvers.partitioner import partition
from tests.assemble.test_local import cost_profile

CHUNKS = 2


def hf_model(name: str) -> nn.Module:
    """Tiny GPT-2, Llama or BERT from a config (no weights downloaded), dropout off."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64, max_position_embeddings=32))
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def loss_of(out: Any) -> Tensor:
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return hidden.logsumexp(-1).mean()


def build(model: nn.Module, inputs: tuple[Tensor, ...], stages: int = 3) -> Pipeline:
    graph = trace(model, microbatch_inputs(inputs, CHUNKS))
    plan = partition(cost_profile(graph), stages=stages, method="dp", chunks=CHUNKS,
                     devices=["cpu"] * stages)
    return pipeline(model, inputs, devices=["cpu"] * stages, chunks=CHUNKS, plan=plan, graph=graph)


def assert_same_step(pipe: nn.Module, model: nn.Module, reference: nn.Module, x: Tensor,
                     loss: Callable[[Any], Tensor] = loss_of) -> None:
    """Loss and every gradient of the pipeline equal the reference's on ``x``."""
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    got, want = loss(pipe(x)), loss(reference(x))
    assert_close(got, want)
    got.backward()
    want.backward()
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        assert_close(p.grad, ref[name].grad, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_pipeline_traced_at_one_length_matches_the_model_at_others(name: str) -> None:
    model = hf_model(name)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = build(model, (ids,))
        assert pipe.graph.source == "export"
        traced = pipe.plan.fingerprint
        for length in (5, 13):  # shorter and longer than traced, odd: nothing divides evenly
            assert_same_step(pipe, model, reference, torch.randint(0, 64, (6, length)))
    assert pipe.plan.fingerprint == traced == pipe.graph.fingerprint  # keyed to the traced shape


def test_fx_graph_runs_other_lengths_and_batches() -> None:
    from autopipe.examples import get_example

    ex = get_example("gpt", batch_size=4)  # TinyGPT: torch.fx, positions sliced to the length
    reference = copy.deepcopy(ex.model)
    pipe = build(ex.model, ex.inputs, stages=2)
    assert pipe.graph.source == "fx"
    for shape in ((4, 5), (6, 20)):
        assert_same_step(pipe, ex.model, reference, torch.randint(0, 256, shape),
                         loss=lambda out: out.logsumexp(-1).mean())


class FixedView(nn.Module):
    """Reshapes to a constant width: the length (dimension 1) must be 16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(128, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return self.head(h.reshape(h.size(0), 128))


class FixedByInt(FixedView):
    """The same through int(size): torch.fx cannot trace it, torch.export fixes the size."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        n = int(h.shape[1])
        return self.head(h.reshape(h.size(0), n * 8))


class LoopInLeaf(nn.Module):
    """A Python loop over the length inside a leaf: the symbolic run fixes the length, a run at
    another length shows it is not fixed (see [Note: dynamic sizes])."""

    class Sum(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            out = x[:, 0]
            for i in range(1, x.size(1)):
                out = out + x[:, i]
            return out

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.sum = self.Sum()

    def forward(self, x: Tensor) -> Tensor:
        return self.sum(self.proj(x))


@pytest.mark.parametrize(("model", "source"), [(FixedView, "fx"), (FixedByInt, "export")])
def test_a_size_the_model_fixes_is_named_in_one_line(model: type[nn.Module], source: str) -> None:
    m = model()
    pipe = build(m, (torch.randn(4, 16, 8),), stages=2)
    assert pipe.graph.source == source
    with pytest.raises(TraceError) as info:
        pipe(torch.randn(4, 12, 8))
    message = str(info.value)
    assert message.startswith("dimension 1 of input 'x' is 12, but the model fixes it at 16 ")
    assert message.endswith("pass inputs with 16 there, or make the model compute that size from "
                            "its input")
    assert "\n" not in message
    with pytest.raises(TraceError, match=r"^dimension 2 of input 'x' is 9, but the model fixes it at 8"):
        pipe(torch.randn(4, 16, 9))  # a Linear's width
    assert pipe(torch.randn(6, 16, 8)).shape == (6, 4)  # another batch runs


def test_a_loop_over_a_size_in_a_leaf_does_not_fix_it() -> None:
    m = LoopInLeaf()
    graph = trace(m, (torch.randn(2, 16, 8),), leaf_modules=[LoopInLeaf.Sum])
    assert graph.source == "fx"
    x = torch.randn(2, 11, 8)
    assert_close(graph.gm(x), m(x))  # no check refuses length 11
    with pytest.raises(TraceError, match="dimension 2 of input 'x' is 3, but the model fixes it at 8"):
        graph.gm(torch.randn(2, 11, 3))


def test_a_bounded_length_names_the_bound() -> None:
    model = hf_model("bert")  # 32 positions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, (torch.randint(0, 64, (2, 8)),))
        with pytest.raises(TraceError, match=r"^dimension 1 of input 'input_ids' is 40, but the "
                                             r"model allows 2\.\.32 there .*pass inputs with a size "
                                             r"in 2\.\.32$"):
            graph.gm(torch.randint(0, 64, (2, 40)), **graph.kwargs)


def test_check_inputs_rules() -> None:
    rules = (("fixed", 0, 0, 4, 0), ("same", 1, 1, 0, 1), ("range", 1, 0, 3, 0))
    names = ("a", "b")
    check_inputs(rules, names, torch.ones(4, 5), torch.ones(3, 5))
    with pytest.raises(TraceError, match=r"^dimension 0 \(the batch: here a micro-batch\) of input "
                                         r"'a' is 2, but the model fixes it at 4"):
        check_inputs(rules, names, torch.ones(2, 5), torch.ones(3, 5))
    with pytest.raises(TraceError, match=r"^dimension 1 of input 'b' is 6 but dimension 1 of input "
                                         r"'a' is 5; the model needs them equal"):
        check_inputs(rules, names, torch.ones(4, 5), torch.ones(3, 6))
    with pytest.raises(TraceError, match=r"input 'b' is 2, but the model allows >= 3 there"):
        check_inputs(rules, names, torch.ones(4, 5), torch.ones(2, 5))
