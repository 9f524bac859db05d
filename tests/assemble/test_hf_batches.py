"""HuggingFace batches: ``pipe(**batch)`` with keyword inputs, and the loss the model computes.

Padding (attention_mask zeros) and ignored labels (-100) are spread unevenly over the
micro-batches, so the pipeline's ``.loss`` equals the model's whole-batch loss only if each
micro-batch is weighted by its counted tokens ([Note: a loss the model computes] in
executor/model_loss.py); every gradient is compared with a deep copy of the plain model.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe.assemble.local import Pipeline, pipeline
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.solvers.partitioner import partition
from executor.errors import ExecutorError, MicroBatchError
from tests.assemble.test_local import cost_profile

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 64  # vocabulary


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, vocab_size=V))


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=V, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def causal_batch(rows: int = 8, length: int = 8) -> dict[str, Tensor]:
    """Right padding and ignored labels, far more of both in some rows than in others."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, 3:] = 0
    mask[1, 5:] = 0
    mask[rows - 1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :7] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def masked_batch(rows: int = 8, length: int = 8) -> dict[str, Tensor]:
    batch = causal_batch(rows, length)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(rows, length, generator=g) < torch.linspace(0.1, 0.9, rows)[:, None]
    batch["labels"] = batch["labels"].masked_fill(~keep, -100)  # few masked tokens first
    batch["labels"][0, 0] = 7  # every micro-batch counts some
    return batch


def seq2seq_batch(rows: int = 6) -> dict[str, Tensor]:
    batch = causal_batch(rows, 7)
    labels = batch["labels"][:, :5].clone()
    labels[0, 2:] = -100
    labels[3, 1:] = -100
    batch["labels"] = labels
    return batch


def micro(batch: dict[str, Tensor], chunks: int) -> dict[str, Tensor]:
    rows = math.ceil(next(iter(batch.values())).shape[0] / chunks)
    return {k: v[:rows] for k, v in batch.items()}


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, Tensor]], int]] = {
    "llama": (_llama, causal_batch, 4),
    "gpt2": (_gpt2, causal_batch, 3),
    "bert": (_bert, masked_batch, 4),
    "t5": (_t5, seq2seq_batch, 3),
}


@functools.cache
def traced(name: str) -> tuple[nn.Module, nn.Module, LayerGraph, dict[str, Tensor]]:
    """The model (seeded), a deep copy of it, its trace on one micro-batch and the batch: traced
    once per test session, by the one-process pipelines and the 2-rank test's plan alike."""
    make, make_batch, chunks = MODELS[name]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    batch = make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, (), example_kwargs=micro(batch, chunks))
    return model, reference, graph, batch


@pytest.fixture(scope="module", params=list(MODELS))
def built(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Module, Pipeline, dict[str, Tensor]]:
    model, reference, graph, batch = traced(request.param)
    chunks = MODELS[request.param][2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = partition(cost_profile(graph), devices=["cpu"] * 3, method="dp", chunks=chunks,
                         recompute="except_last")
        pipe = pipeline(model, example_kwargs=batch, devices=["cpu"] * 3, chunks=chunks,
                        plan=plan, graph=graph)
    return model, reference, pipe, batch


@pytest.mark.slow
def test_the_models_loss_and_gradients_equal_the_whole_batch(
        built: tuple[nn.Module, nn.Module, Pipeline, dict[str, Tensor]]) -> None:
    model, reference, pipe, batch = built
    assert pipe.graph.loss is not None, "the model's loss node is found and counted"
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    out = pipe(**batch)
    expected = reference(**batch)
    assert type(out) is type(expected)
    assert_close(out.loss, expected.loss)
    assert_close(out.logits, expected.logits)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert_close(p.grad, q.grad, msg=name)


def test_the_loss_is_not_the_plain_mean_of_micro_batches(
        built: tuple[nn.Module, nn.Module, Pipeline, dict[str, Tensor]]) -> None:
    """The batches are uneven enough that averaging micro-batch losses blindly would differ."""
    _model, reference, pipe, batch = built
    with torch.no_grad():
        whole = reference(**batch).loss
        rows = [reference(**{k: v[s] for k, v in batch.items()}).loss
                for s in _slices(next(iter(batch.values())).shape[0], pipe.chunks)]
    assert abs(float(torch.stack(rows).mean() - whole)) > 1e-3


def _slices(rows: int, chunks: int) -> list[slice]:
    sizes = [len(c) for c in torch.arange(rows).tensor_split(chunks)]
    sizes.sort(reverse=True)
    starts = [sum(sizes[:i]) for i in range(chunks)]
    return [slice(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def test_bad_keyword_inputs_are_one_line(
        built: tuple[nn.Module, nn.Module, Pipeline, dict[str, Tensor]]) -> None:
    _model, _reference, pipe, batch = built
    name = next(iter(batch))
    with pytest.raises(ExecutorError, match=r"^unexpected keyword input 'labelz': .*example_kwargs"):
        pipe(**batch, labelz=batch["labels"])
    with pytest.raises(ExecutorError, match=rf"^keyword input '{name}' is missing: "):
        pipe(**{k: v for k, v in batch.items() if k != name})
    with pytest.raises(MicroBatchError, match="inconsistent batch sizes"):
        pipe(**{**batch, "labels": batch["labels"][:-1]})
    with pytest.raises(MicroBatchError):
        pipe(**{k: v[: pipe.chunks - 1] for k, v in batch.items()})


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_loss_fn_in_one_process_is_the_whole_batch_loss() -> None:
    torch.manual_seed(0)
    model = Regressor()
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 4), torch.randn(7, 2)  # 3, 2, 2 rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, (x[:3],))
        plan = partition(cost_profile(graph), devices=["cpu"] * 2, method="dp", chunks=3,
                         recompute="except_last")
        pipe = pipeline(model, (x,), devices=["cpu"] * 2, chunks=3, plan=plan, graph=graph,
                        loss_fn=F.mse_loss)
    loss = pipe(x, target=y)
    expected = F.mse_loss(reference(x), y)
    assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad)
    with pytest.raises(ExecutorError, match=r"pipe\(\*inputs, target=y\)"):
        pipe(x)


# family -> (schedule, batch) on 2 ranks: 1F1B runs a micro-batch's backward before later
# forwards. PipelineStage needs equal micro-batches: GPT-2's 3 chunks take 9 rows, not 8 (the
# same micro-batch shape, so the cached trace's plan fits)
RANKED: dict[str, tuple[str, Callable[[], dict[str, Tensor]]]] = {
    "llama": ("1f1b", causal_batch),
    "gpt2": ("gpipe", functools.partial(causal_batch, 9)),
    "bert": ("1f1b", masked_batch),
    "t5": ("gpipe", seq2seq_batch),
}


def _families_on_ranks(rank: int, plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each family in turn: one trace per rank (distributed_pipeline's own) and the parent's
    plan, so nothing is measured; the model seeded as in :func:`traced`."""
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    values = {}
    for name, plan in plans.items():
        make, _, chunks = MODELS[name]
        schedule, make_batch = RANKED[name]
        torch.manual_seed(0)
        model = make()
        batch = make_batch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = distributed_pipeline(model, example_kwargs=batch, chunks=chunks,
                                        schedule=schedule, plan=Plan.from_dict(plan),
                                        timeout=30)
        loss = pipe.step(**batch)
        grads = {n: p.grad for n, p in pipe.stage_module.named_parameters()}
        values[name] = {"loss": loss, "grads": grads, "eval": pipe.eval_step(**batch)}
    return values


@pytest.mark.slow
@pytest.mark.compat  # the GPU machine's torch 2.11: [Note: integers across a cut]
@pytest.mark.timeout(200)
def test_two_ranks_weight_the_models_loss_before_1f1b_runs() -> None:
    """Llama, GPT-2, BERT (masked LM) and T5 on 2 ranks, in one call on the pool: step(**batch)
    gives the model's whole-batch loss and every gradient. Under 1F1B a micro-batch's backward
    runs before later forwards: the weights come first. eval_step(**batch) returns the model's
    output with the loss weighted as step's."""
    from tests.assemble.test_ranks import _ok, spawn

    plans, fresh, batches = {}, {}, {}
    for name in RANKED:
        _model, fresh[name], graph, _ = traced(name)
        batches[name] = RANKED[name][1]()
        plans[name] = partition(cost_profile(graph), stages=2, method="dp",
                                chunks=MODELS[name][2], recompute="never").to_dict()
    values = _ok(spawn(_families_on_ranks, plans, timeout=190))
    for name in RANKED:
        batch = batches[name]
        reference = copy.deepcopy(fresh[name])  # the seeded model's weights (no test steps them)
        reference.zero_grad(set_to_none=True)
        expected = reference(**batch)
        expected.loss.backward()
        first, last = values[0][name], values[1][name]
        assert first["loss"] is None and first["eval"] is None, name
        assert_close(last["loss"], expected.loss.detach(), msg=name)
        evaluated = last["eval"]
        assert type(evaluated) is type(expected), name
        assert_close(evaluated.loss, expected.loss.detach(), msg=name)
        assert_close(evaluated.logits, expected.logits.detach(), msg=name)
        covered = set()
        for v in (first, last):
            for param, grad in v["grads"].items():
                p = reference.get_parameter(param)
                assert_close(grad, p.grad, msg=f"{name}: {param}")
                covered.add(id(p))
        assert covered == {id(p) for p in reference.parameters()}, name


@pytest.mark.compat  # torch 2.11's export nests the rotary embedding's autocast region
@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
def test_the_models_loss_under_bf16_on_worker_threads(recompute: str) -> None:
    """precision="bf16" with every stage on a worker thread: the loss and gradients of the plain
    model under the same autocast, to bf16's tolerance, in every recomputation mode."""
    from tests.assemble.test_precision import _close, assert_ran_in_bf16, record_calls

    model, reference, graph, batch = traced("llama")
    chunks = MODELS["llama"][2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = partition(cost_profile(graph), devices=["cpu"] * 3, method="dp", chunks=chunks,
                         recompute=recompute)
        pipe = pipeline(model, example_kwargs=batch, devices=["cpu"] * 3, chunks=chunks,
                        plan=plan, graph=graph, precision="bf16")
    pipe.threads = True  # as on distinct devices: autocast must reach the workers
    calls = record_calls(pipe.stages)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    out = pipe(**batch)
    assert_ran_in_bf16(calls, range(3), chunks)  # an fp32 run would pass the tolerances below
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**batch)
    # values, not dtype: the graph traced in fp32 holds the loss's logits.float() as its output
    _close(out.logits, expected.logits, "logits")
    _close(out.loss, expected.loss, "loss")
    del calls[:]
    out.loss.backward()
    # what backward recomputed (every micro-batch but the last under except_last, none under
    # never), it recomputed in bf16 too
    assert_ran_in_bf16(calls, [] if recompute == "never" else range(3),
                       chunks - (recompute == "except_last"), cut=False)
    expected.loss.backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref = grads[name].grad
        assert (p.grad is None) == (ref is None), name
        if ref is not None:
            assert p.grad is not None and p.grad.dtype == torch.float32
            _close(p.grad, ref, name, tol=6e-2)
