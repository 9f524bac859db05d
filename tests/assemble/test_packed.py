"""Packed sequences through autopipe.pipeline: one row of sequences end to end, as
DataCollatorWithFlattening makes it, cut at sequence starts ([Note: packed rows split at
sequence starts] in executor/packed.py)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import DataCollatorWithFlattening

import autopipe
from autopipe import BuildError
from executor.errors import DistributedError, ExecutorError
from tests.assemble.test_hf_batches import V, _gpt2, _llama
from tests.conftest import skip_if_no_cuda


def packed(lengths: list[int], seed: int = 0) -> dict[str, Tensor]:
    """HuggingFace's own packing collator over sequences of these lengths."""
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, V, (n,), generator=g).tolist()} for n in lengths]
    return dict(DataCollatorWithFlattening()(features, return_tensors="pt"))


def made_up(model: nn.Module, batch: dict[str, Tensor], chunks: int) -> autopipe.Pipeline:
    """``model``'s pipeline of a packed ``batch`` on two CPU stages split by made-up costs
    (tests/assemble/test_local.py's ``cost_profile``): traced on the first micro-batch, nothing
    measured, for tests whose subject is not the plan."""
    from autopipe.assemble.setup import example_batch
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile

    graph = trace(model, (), example_kwargs=example_batch(model, (), batch, chunks).micro_kwargs)
    plan = partition(cost_profile(graph), stages=2, chunks=chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # two stages on one CPU: the placement warning
        return autopipe.pipeline(model, example_kwargs=batch, devices=["cpu", "cpu"], chunks=chunks,
                                 plan=plan, graph=graph)


def assert_the_plain_models(pipe: nn.Module, model: nn.Module, reference: nn.Module,
                            batch: dict[str, Tensor]) -> None:
    """The pipeline of ``model`` on ``batch``: the logits, loss and every gradient of
    ``reference`` (a copy of it) called with use_cache=False, as the pipeline traced it."""
    out, expected = pipe(**batch), reference(**batch, use_cache=False)
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.loss, expected.loss)
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.compat  # transformers 5.17's packed mask, on the GPU machine's versions
@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_a_packed_row_equals_the_plain_model_and_its_length_may_change(make: Callable[[], nn.Module]) -> None:
    # the plain model called as the pipeline is, with use_cache=False: with a cache HF's sdpa
    # attends across the packed sequences (no training setup), the traced pipeline never does
    model = make()
    ref = copy.deepcopy(model)
    first = packed([5, 7, 3, 9, 4])
    pipe = made_up(model, first, chunks=3)
    for batch in (first, packed([3, 11, 6, 2], seed=1)):  # 28 tokens, then 22: no new trace
        model.zero_grad()
        ref.zero_grad()
        assert_the_plain_models(pipe, model, ref, batch)


def test_a_row_packed_without_separators_or_with_too_few_sequences_is_one_line() -> None:
    batch = packed([5, 7, 3, 9])
    pipe = made_up(_llama(), batch, chunks=2)
    joined = {**batch, "labels": batch["input_ids"].clone()}  # each first label counted: across cuts
    with pytest.raises(ExecutorError, match=r"^the packed row's labels count a token across a cut "
                                            r"between sequences: .* use chunks=1$"):
        pipe(**joined)
    with pytest.raises(ExecutorError, match=r"^the packed row holds 1 sequence\(s\) .* use chunks <= 1$"):
        pipe(**packed([20]))
    with pytest.raises(BuildError, match=r"^the packed row holds 2 sequence\(s\) .* fewer than chunks=3"):
        autopipe.pipeline(_llama(), example_kwargs=packed([4, 4]), devices=["cpu", "cpu"], chunks=3)


def _packed_on_ranks(rank: int, plan: dict[str, Any], batches: list[dict[str, Tensor]]) -> list[dict[str, Any]]:
    """Each batch in turn on this rank: step (gradients zeroed first) and eval_step."""
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    torch.manual_seed(0)
    pipe = distributed_pipeline(_llama(), example_kwargs=batches[0], chunks=2, plan=Plan.from_dict(plan),
                                timeout=30)
    values = []
    for batch in batches:
        pipe.stage_module.zero_grad(set_to_none=True)
        loss = pipe.step(**batch)
        grads = {n: p.grad for n, p in pipe.stage_module.named_parameters()}
        values.append({"loss": loss, "grads": grads, "eval": pipe.eval_step(**batch)})
    try:
        pipe.step(**packed([40, 30, 50, 20], seed=2))  # micro-batches of 70 tokens
    except DistributedError as err:
        values.append({"refused": str(err)})
    return values


@pytest.mark.slow
@pytest.mark.compat  # torch 2.11 runs the example's sizes only, which is all padded rows need
@pytest.mark.timeout(120)
def test_two_ranks_train_and_evaluate_packed_rows_as_the_plain_model() -> None:
    # [Note: packed rows on ranks]: each micro-batch a row padded to the example's 64 tokens; the
    # second batch has another total length (105 tokens, not 28) and runs the same stages; a
    # third, whose micro-batches would need 128, is refused in one line on every rank
    from autopipe.assemble.setup import example_batch
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile
    from tests.assemble.test_ranks import _ok, spawn

    batches = [packed([5, 7, 3, 9, 4]), packed([10, 25, 20, 30, 15, 5], seed=1)]
    torch.manual_seed(0)
    model = _llama()
    micro = example_batch(model, (), batches[0], 2, packed=False)
    assert micro.micro[0].shape == (1, 64)  # the first padded row
    graph = trace(model, (), example_kwargs=micro.micro_kwargs)
    plan = partition(cost_profile(graph), stages=2, method="dp", chunks=2, recompute="never").to_dict()
    first, last = _ok(spawn(_packed_on_ranks, plan, batches, timeout=110))
    for values in (first, last):
        assert values[-1]["refused"] == ("a micro-batch of the packed row holds 70 tokens, more than the 64 "
                                         "of the rows this pipeline was built for: build it with your longest "
                                         "packed batch as example_kwargs, or use more chunks")
    for i, batch in enumerate(batches):
        reference = copy.deepcopy(model)
        expected = reference(**batch, use_cache=False)
        expected.loss.backward()
        assert first[i]["loss"] is None and first[i]["eval"] is None
        torch.testing.assert_close(last[i]["loss"], expected.loss.detach())
        torch.testing.assert_close(last[i]["eval"].logits, expected.logits.detach())
        torch.testing.assert_close(last[i]["eval"].loss, expected.loss.detach())
        covered = set()
        for values in (first[i], last[i]):
            for name, grad in values["grads"].items():
                torch.testing.assert_close(grad, reference.get_parameter(name).grad, msg=name)
                covered.add(name)
        assert covered == {n for n, _ in reference.named_parameters()}


class _Sequences(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Tokenized sequences of different lengths, one per item, for a packing collator."""

    def __init__(self, lengths: list[int]) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = [{"input_ids": torch.randint(1, V, (n,), generator=g).tolist()} for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]


def test_trainer_trains_a_pipeline_on_packed_batches_as_the_plain_model(tmp_path: Path) -> None:
    # DataCollatorWithFlattening packs each batch of 4 sequences into one row; Trainer's defaults
    # otherwise, with accumulation 2 and clipping. The plain model has use_cache=False, without
    # which HF's sdpa attends across the packed sequences
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = _llama()
    plain = copy.deepcopy(model)
    plain.config.use_cache = False
    data = _Sequences([5, 9, 3, 7, 6, 4, 8, 2, 7, 5, 3, 9, 4, 6, 8, 5])
    collate = DataCollatorWithFlattening()
    pipe = made_up(model, collate([data[i] for i in range(4)], return_tensors="pt"), chunks=2)

    def train(m: nn.Module, out: Path) -> list[dict[str, float]]:
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_grad_norm=1.0, learning_rate=1e-3, num_train_epochs=1, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h]

    got, want = train(pipe, tmp_path / "pipe"), train(plain, tmp_path / "plain")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g["grad_norm"], w["grad_norm"], rtol=1e-4, atol=1e-6)
    trained = pipe.state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)


@skip_if_no_cuda
def test_a_packed_row_on_two_cuda_stages_equals_the_plain_model_on_cuda() -> None:
    # the model on the CPU, the packed batch on the GPU: profiled, planned and run on CUDA
    model = _llama()
    reference = copy.deepcopy(model).cuda()
    batch = {k: v.cuda() for k, v in packed([5, 7, 3, 9, 4]).items()}
    pipe = autopipe.pipeline(model, example_kwargs=batch, devices=["cuda", "cuda"], chunks=3)
    assert_the_plain_models(pipe, model, reference, batch)


def _packed_on_replicas(rank: int, plan: dict[str, Any], rows: list[dict[str, Tensor]]) -> dict[str, Any]:
    """One step of this rank's replica on its own packed row (replica r: ``rows[r]``)."""
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = distributed_pipeline(_llama(), example_kwargs=rows[0], chunks=2, plan=Plan.from_dict(plan),
                                    timeout=30)
    loss = pipe.step(**rows[pipe.dp_rank])
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.stage_module.named_parameters()}}


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_replicas_of_two_stages_train_their_packed_rows_as_the_plain_model_the_whole_batch() -> None:
    # each replica packs sequences of its own, of unequal token counts; together they are the
    # plain model's packed batch of all of them: the loss over every token of both rows, and its
    # gradients ([Note: tokens over replicas] in executor/ranks/replicated.py)
    from autopipe.assemble.setup import example_batch
    from autopipe.frontend.tracing.graph import trace
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile
    from tests.assemble.test_ranks import _ok, spawn

    lengths = [[5, 7, 3, 9], [12, 2, 6, 20, 8]]
    features = packed([n for part in lengths for n in part])  # all sequences, one row
    cut = sum(lengths[0])
    rows = [{k: v[:, :cut] for k, v in features.items()}, {k: v[:, cut:] for k, v in features.items()}]
    assert torch.equal(rows[1]["position_ids"][0, :12], torch.arange(12))  # the second row starts a sequence
    torch.manual_seed(0)
    model = _llama()
    graph = trace(model, (), example_kwargs=example_batch(model, (), rows[0], 2, packed=False).micro_kwargs)
    plan = partition(cost_profile(graph), stages=2, method="dp", chunks=2, recompute="never", data_parallel=2,
                     dp_mode="ddp").to_dict()
    values = _ok(spawn(_packed_on_replicas, plan, rows, world=4, timeout=140))
    reference = copy.deepcopy(model)
    expected = reference(**features, use_cache=False)
    expected.loss.backward()
    losses = [v["loss"] for v in values if v["loss"] is not None]
    assert len(losses) == 2  # each replica's last stage
    for loss in losses:
        torch.testing.assert_close(loss, expected.loss.detach())
    covered = set()
    for rank, v in enumerate(values):
        for name, grad in v["grads"].items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, msg=f"rank {rank} {name}")
            covered.add(name)
    assert covered == {n for n, _ in reference.named_parameters()}
