"""autopipe.pipeline: the pipelined model must be the model (outputs, losses, gradients)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe import BuildError, PlanError, ProfileError
from autopipe.assemble.local import pipeline
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.profile_table import Profile
from autopipe.examples import Example, TinyGPT, get_example
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.solvers.partitioner import partition
from executor import GPipe
from tests.conftest import skip_if_no_cuda
from tests.models import tiny_gpt2

MODES = ("always", "except_last", "never")


def cost_profile(graph: LayerGraph) -> Profile:
    """A profile with made-up but layer-dependent costs: enough to exercise the partitioner."""
    params = [graph.nx.nodes[n]["param_bytes"] for n in graph.layers]
    df = pd.DataFrame(
        {
            "layer": graph.layers,
            "fwd_ms": [1.0 + p / 1e5 for p in params],
            "bwd_ms": [2.0 + 2 * p / 1e5 for p in params],
            "param_bytes": params,
            "output_bytes": [graph.nx.nodes[n]["output_bytes"] for n in graph.layers],
            "saved_bytes": [graph.nx.nodes[n]["output_bytes"] for n in graph.layers],
        }
    )
    return Profile.from_frame(df, edges=graph.edges(), meta={"fingerprint": graph.fingerprint})


def made_up_pipeline(model: nn.Module, inputs: tuple[Any, ...] = (), *,
                     example_kwargs: dict[str, Any] | None = None, chunks: int = 2,
                     devices: tuple[str, str] = ("cpu", "cpu"), **kwargs: Any) -> autopipe.Pipeline:
    """``model`` on two CPU stages split by made-up costs (:func:`cost_profile`), traced on its
    first micro-batch: no profiling, for tests whose subject is not the plan (``pipe.plan``
    rebuilds the same split, e.g. with ``weights=``). ``kwargs`` go to pipeline()."""
    keywords = example_kwargs or {}
    micro = microbatch_inputs((*inputs, *keywords.values()), chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages on one CPU: the placement warning
        graph = trace(model, micro[:len(inputs)], example_kwargs=dict(zip(keywords, micro[len(inputs):],
                                                                          strict=True)) or None)
        plan = partition(cost_profile(graph), stages=2, chunks=chunks)
        return pipeline(model, inputs, example_kwargs=example_kwargs, devices=list(devices), chunks=chunks,
                        plan=plan, graph=graph, **kwargs)


def check_transparent(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss_of: Callable[[Any], Tensor],
    k: int,
    recompute: str,
    chunks: int = 2,
    graph: LayerGraph | None = None,
    **trace_kwargs: Any,
) -> GPipe:
    """``graph``: ``model``'s own trace, to reuse one (see :func:`traced`); else traced here."""
    reference = copy.deepcopy(model)
    if graph is None:
        graph = trace(model, microbatch_inputs(inputs, chunks), **trace_kwargs)
    # a plan for where it runs and what it recomputes: neither of pipeline()'s warnings applies
    plan = partition(cost_profile(graph), devices=["cpu"] * k, method="dp", chunks=chunks,
                     recompute=recompute)
    pipe = pipeline(model, inputs, devices=["cpu"] * k, chunks=chunks, plan=plan, graph=graph)
    out = pipe(*inputs)
    # a HuggingFace model is traced with use_cache=False unless told (a cache is no training
    # value: autopipe.frontend.tracing.graph.trace): the pipeline is the model called so
    plain = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", False) else {}
    expected = reference(*inputs, **plain)
    # the outputs themselves, row by row: a loss that does not depend on the rows' order (a mean)
    # would not notice micro-batches joined back in another order
    assert type(out) is type(expected)
    torch.testing.assert_close(out, expected, msg=lambda m: f"outputs differ: {m}")
    loss, ref_loss = loss_of(out), loss_of(expected)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        if ref_grad is None:  # a parameter the loss does not reach gets no gradient at all
            assert p.grad is None, f"{name} got a gradient the unpipelined model does not have"
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grad, msg=f"gradient of {name}")
    return pipe


def traced(model: nn.Module, inputs: tuple[Any, ...], chunks: int = 2) -> tuple[nn.Module, LayerGraph]:
    """``model`` and its trace, for a module-scoped fixture: torch.export is most of a
    transformer test's time, and a graph is only ever built with the model it was traced from
    (its stages hold that model's parameters), so one model is reused and each use clears its
    gradients first (:func:`fresh_grads`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, trace(model, microbatch_inputs(inputs, chunks))


def fresh_grads(model: nn.Module) -> nn.Module:
    model.zero_grad(set_to_none=True)  # as a model that was never run
    return model


@pytest.fixture(scope="module")
def bundled() -> Iterator[Callable[[str], tuple[Example, LayerGraph]]]:
    """``bundled(name)``: the example (``get_example`` is seeded: every call builds the same
    model and batch) and its trace, made once per module as :func:`traced` does; each call
    clears the model's gradients (:func:`fresh_grads`)."""
    made: dict[str, tuple[Example, LayerGraph]] = {}

    def get(name: str) -> tuple[Example, LayerGraph]:
        if name not in made:
            ex = get_example(name, batch_size=4)
            made[name] = ex, trace(ex.model, microbatch_inputs(ex.inputs, 2))
        ex, graph = made[name]
        fresh_grads(ex.model)
        return ex, graph

    yield get
    made.clear()


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "unet"])
@pytest.mark.parametrize("recompute", MODES)
@pytest.mark.compat
def test_bundled_examples_match_unpipelined(
    name: str, recompute: str, bundled: Callable[[str], tuple[Example, LayerGraph]]
) -> None:
    for k in (1, 2, 3, 4):
        ex, graph = bundled(name)
        check_transparent(ex.model, ex.inputs, lambda out, ex=ex: ex.loss_fn(out, ex.target),
                          k, recompute, graph=graph)


@pytest.fixture(scope="module")
def transformer() -> tuple[nn.Module, LayerGraph, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                           dim_feedforward=32, dropout=0.0, batch_first=True)
    inputs = (torch.randn(4, 6, 16), torch.randn(4, 5, 16))
    return *traced(model, inputs), inputs


@pytest.mark.parametrize("recompute", MODES)
def test_nn_transformer_matches(
    recompute: str, transformer: tuple[nn.Module, LayerGraph, tuple[Tensor, Tensor]]
) -> None:
    model, graph, inputs = transformer
    for k in (1, 2, 3, 4):
        check_transparent(fresh_grads(model), inputs, lambda out: out.pow(2).mean(), k, recompute,
                          graph=graph)


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, LayerGraph, Tensor]:
    torch.manual_seed(0)
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (4, 8))
    return *traced(model, (ids,)), ids


@pytest.mark.parametrize("recompute", MODES)
@pytest.mark.compat
def test_huggingface_gpt2_matches(recompute: str, gpt2: tuple[nn.Module, LayerGraph, Tensor]) -> None:
    model, graph, ids = gpt2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in (1, 2, 3, 4):
            pipe = check_transparent(fresh_grads(model), (ids,),
                                     lambda out: out.logits.logsumexp(-1).mean(), k, recompute,
                                     graph=graph)
            # export keeps one name per tied tensor; build restores the plain model's keys
            assert set(pipe.state_dict()) == set(model.state_dict())
            pipe.load_state_dict(model.state_dict())


def test_adamw_steps_keep_parameters_equal_and_uneven_microbatch() -> None:
    # (not the GPT: its attention key bias has a mathematically zero gradient, and Adam turns
    # that float noise into +-lr steps, in the reference model as much as in the pipeline)
    ex = get_example("unet", batch_size=7)  # 7 rows into 3 micro-batches: 3, 3, 1
    reference = copy.deepcopy(ex.model)
    graph = trace(ex.model, microbatch_inputs(ex.inputs, 3))
    plan = partition(cost_profile(graph), devices=["cpu"] * 3, method="dp", chunks=3)
    pipe = pipeline(ex.model, ex.inputs, devices=["cpu"] * 3, chunks=3, plan=plan, graph=graph)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        for o, m in ((opt, pipe), (ref_opt, reference)):
            o.zero_grad()
            ex.loss_fn(m(*ex.inputs), ex.target).backward()
            o.step()
    for (name, p), q in zip(ex.model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"parameter {name}")
    # the user's own model object was trained (parameters are shared, not copied)
    assert all(p is q for p, q in zip(pipe.parameters(), ex.model.parameters(), strict=True))


def test_eval_mode_and_no_grad() -> None:
    ex = get_example("cnn", batch_size=4)
    pipe = check_transparent(ex.model, ex.inputs, lambda out: out.sum(), 2, "always")
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(*ex.inputs), ex.model.eval()(*ex.inputs))


def test_dropout_recomputation_replays_masks() -> None:
    grads = {}
    for mode in ("always", "never"):
        torch.manual_seed(0)
        model = TinyGPT(dropout=0.3)
        ids = torch.randint(0, 256, (4, 16))
        graph = trace(model, microbatch_inputs((ids,), 2))
        plan = partition(cost_profile(graph), devices=["cpu"] * 2, method="dp", chunks=2)
        # one split for both modes (the masks depend on it); the plan's mode is overridden
        with pytest.warns(UserWarning, match=rf"recompute='{mode}' overrides the plan's "
                                             r"'except_last', for which its times and memory"):
            pipe = pipeline(model, (ids,), devices=["cpu"] * 2, chunks=2, recompute=mode,
                            plan=plan, graph=graph)
        torch.manual_seed(1)
        pipe(ids).logsumexp(-1).mean().backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["always"], grads["never"], strict=True):
        torch.testing.assert_close(a, b)


def test_state_dict_uses_original_keys_and_round_trips() -> None:
    ex = get_example("unet", batch_size=4)
    graph = trace(ex.model, microbatch_inputs(ex.inputs, 2))
    plan = partition(cost_profile(graph), devices=["cpu"] * 3, method="dp", chunks=2)
    pipe = pipeline(ex.model, ex.inputs, devices=["cpu"] * 3, chunks=2, plan=plan, graph=graph)
    state = pipe.state_dict()
    assert set(state) == set(ex.model.state_dict())
    fresh = get_example("unet", batch_size=4, seed=5).model
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(*ex.inputs), pipe(*ex.inputs))
    pipe.load_state_dict(get_example("unet", batch_size=4, seed=7).model.state_dict())
    assert not torch.equal(pipe(*ex.inputs), fresh(*ex.inputs))


@pytest.mark.compat
def test_measures_and_partitions_when_no_plan_given() -> None:
    ex = get_example("mlp", batch_size=8)
    pipe = pipeline(ex.model, ex.inputs, devices=["cpu", "cpu"], chunks=2)
    assert len(pipe.plan.stages) == 2
    torch.testing.assert_close(pipe(*ex.inputs), ex.model(*ex.inputs))
    assert autopipe.pipeline is pipeline


def test_errors() -> None:
    ex = get_example("mlp", batch_size=4)
    graph = trace(ex.model, microbatch_inputs(ex.inputs, 2))
    plan = partition(cost_profile(graph), stages=2, method="dp", chunks=2)
    with pytest.raises(BuildError, match="2 stages but 3 devices"):
        pipeline(ex.model, ex.inputs, devices=["cpu"] * 3, chunks=2, plan=plan)
    with pytest.raises(BuildError, match="chunks=8 > batch size 4: micro-batches would be empty"):
        pipeline(ex.model, ex.inputs, devices=["cpu"] * 2, chunks=8, plan=plan)
    with pytest.raises(BuildError, match="devices is empty"):
        pipeline(ex.model, ex.inputs, devices=[], chunks=2, plan=plan)
    # a plan made for another model (or another micro-batch shape) is refused
    with pytest.raises(PlanError, match="fingerprint"):
        pipeline(ex.model, ex.inputs, devices=["cpu"] * 2, chunks=1, plan=plan)
    gpu_profile = cost_profile(graph)
    gpu_profile.meta.update(device="NVIDIA H200", device_type="cuda")
    with pytest.raises(ProfileError, match="measured on cuda .* runs on cpu"):
        pipeline(ex.model, ex.inputs, devices=["cpu"] * 2, chunks=2, profile=gpu_profile)
    other = get_example("cnn", batch_size=4)
    with pytest.raises(ProfileError, match="fingerprint"):
        pipeline(other.model, other.inputs, devices=["cpu"] * 2, chunks=2,
                 profile=cost_profile(graph))


def test_prediction_benchmark_smoke() -> None:
    from benchmarks.executor_vs_prediction import main

    (row,) = main(["--models", "mlp", "--batch", "8", "--chunks", "2", "--checkpoints", "never",
                   "--repeats", "2", "--rounds", "1"])
    assert row.predicted_ms > 0 and row.measured_ms > 0 and row.loop_ms > 0
    # that the script runs, not how good the prediction is (wall time of a tiny model on a shared
    # machine): tests/assemble/test_prediction.py asserts that, in CPU time
    assert 0.05 < row.ratio < 20


@pytest.mark.parametrize("name", ["gpt", "hf"])
def test_tied_embedding_and_head_on_different_devices(
    name: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # One CPU stands in for two GPUs: the runtime is told the stages' devices differ, so the
    # tied head fetches the embedding's weight ([Note: ties across devices] in executor.local.gpipe).
    monkeypatch.setattr("executor.local.placement._same_device", lambda a, b: False)
    graph = None
    if name == "gpt":
        ex = get_example("gpt", batch_size=4)
        model, inputs = ex.model, ex.inputs

        def loss_of(out: Any) -> Tensor:
            return ex.loss_fn(out, ex.target)
    else:
        model, graph, ids = request.getfixturevalue("gpt2")
        model, inputs = fresh_grads(model), (ids,)

        def loss_of(out: Any) -> Tensor:
            return out.logits.logsumexp(-1).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = check_transparent(model, inputs, loss_of, 2, "except_last", graph=graph)
    assert set(pipe.state_dict()) == set(model.state_dict())
    tied = [p for p in pipe.parameters() if p.shape[0] in (256, 64) and p.dim() == 2]
    assert len({id(p) for p in tied}) == len(tied)  # the tied weight is listed once


def test_stage_that_does_not_fit_its_device_is_refused() -> None:
    from autopipe.assemble.setup import check_device_memory

    ex = get_example("mlp", batch_size=4)
    graph = trace(ex.model, microbatch_inputs(ex.inputs, 2))
    plan = partition(cost_profile(graph), stages=2, method="dp", chunks=2)
    gib = 2**30
    free = {"cuda:0": 8 * gib, "cuda:1": 1000}
    check_device_memory(plan, ["cpu", "cpu"])  # the CPU reports no free memory: not checked
    check_device_memory(plan, ["cuda:0", "cuda:0"], lambda d: free.get(str(d)))
    with pytest.raises(BuildError, match=r"stage\(s\) \[1\] need .* but cuda:1 has 1000 B free; "
                                         r"use more stages.*memory_limit='1000 B'"):
        check_device_memory(plan, ["cuda:0", "cuda:1"], lambda d: free.get(str(d)))
    both = sum(plan.stage_memory)
    with pytest.raises(BuildError, match=r"stage\(s\) \[0, 1\]"):  # stages on one device add up
        check_device_memory(plan, ["cuda:1", "cuda:1"], lambda d: both - 1)


@pytest.fixture(scope="module")
def llama_and_bert() -> tuple[tuple[nn.Module, LayerGraph], tuple[nn.Module, LayerGraph], Tensor]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64))
    # BERT's pooler output is not in this loss: its parameters must get no gradient, as in the
    # unpipelined model (not zeros, which AdamW would act on)
    bert = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ids = torch.randint(0, 64, (4, 8))
    return traced(llama, (ids,)), traced(bert, (ids,)), ids


@pytest.mark.slow
@pytest.mark.parametrize("recompute", MODES)
def test_huggingface_llama_and_bert_match(
    recompute: str,
    llama_and_bert: tuple[tuple[nn.Module, LayerGraph], tuple[nn.Module, LayerGraph], Tensor],
) -> None:
    (llama, llama_graph), (bert, bert_graph), ids = llama_and_bert
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_transparent(fresh_grads(llama), (ids,), lambda out: out.logits.logsumexp(-1).mean(), 3,
                          recompute, graph=llama_graph)
        check_transparent(fresh_grads(bert), (ids,), lambda out: out.last_hidden_state.pow(2).mean(),
                          3, recompute, graph=bert_graph)
    assert bert.pooler.dense.weight.grad is None


def test_checkpoint_is_recomputes_old_name_for_one_release() -> None:
    """[Note: recompute, not checkpoint]: pipeline(checkpoint=) builds pipeline(recompute=)'s
    pipeline, with one DeprecationWarning line."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(8, 8)
    with pytest.warns(DeprecationWarning, match=r"^pipeline\(checkpoint='always'\) is now "
                                                 r"pipeline\(recompute='always'\)"):
        pipe = pipeline(model, (x,), devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    assert pipe.recompute_modes == ["always", "always"] and pipe.plan.recompute == "always"
    torch.testing.assert_close(pipe(x), model(x))


@skip_if_no_cuda
@pytest.mark.parametrize("batch_on", ["cpu", "cuda"])
def test_a_cpu_model_measured_planned_and_run_on_cuda_is_the_plain_model(batch_on: str) -> None:
    # what a user of one GPU machine writes: the model built on the CPU, no profile and no plan,
    # the batch on either device ([Note: traced on the model's device] in
    # autopipe/frontend/tracing/capture.py): measured, planned and run on two CUDA stages, the
    # pipeline's loss and every gradient are the plain model's on CUDA
    ex = get_example("gpt", batch_size=8)
    reference = copy.deepcopy(ex.model).cuda()
    inputs, target = tuple(x.to(batch_on) for x in ex.inputs), ex.target.cuda()
    pipe = autopipe.pipeline(ex.model, inputs, devices=["cuda", "cuda"], chunks=2)
    assert {p.device.type for p in pipe.parameters()} == {"cuda"}
    loss = ex.loss_fn(pipe(*inputs), target)
    expected = ex.loss_fn(reference(*(x.cuda() for x in ex.inputs)), target)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    for (name, p), q in zip(reference.named_parameters(), ex.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
