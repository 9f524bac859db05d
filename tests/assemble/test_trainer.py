"""HuggingFace's Trainer trains a pipeline as it trains the model ([Note: the model's call] in
autopipe/assemble/local.py): Trainer(model=pipe) with Trainer's defaults (columns filtered by
the signature, num_items_in_batch over accumulated batches) and gradient accumulation 2 and
clipping, against Trainer(model=the plain model): the same logged losses and gradient norms,
and the same weights after the epoch, for a Llama, a GPT-2 with a tied head and a BERT masked LM."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from tests.assemble.test_hf_batches import _bert, _gpt2, _llama, causal_batch, masked_batch
from tests.assemble.test_local import made_up_pipeline
from tests.conftest import skip_if_no_cuda

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer's own dependency

ROWS, PER_STEP = 16, 4  # 16 rows, 4 per forward, 2 forwards accumulated per optimizer step


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset of one row per item, as a tokenized dataset gives them to the collator."""

    def __init__(self, batch: dict[str, Tensor]) -> None:
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(ROWS)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.rows[i]


def _train(model: nn.Module, data: dict[str, Tensor], out: Path) -> list[dict[str, Any]]:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=PER_STEP, gradient_accumulation_steps=2,
        max_grad_norm=1.0, learning_rate=1e-3, num_train_epochs=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows(data))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize(("make", "batch"), [(_llama, causal_batch), (_gpt2, causal_batch), (_bert, masked_batch)],
                         ids=["llama", "gpt2", "bert"])
def test_trainer_trains_the_pipeline_as_the_plain_model(make: Callable[[], nn.Module],
                                                        batch: Callable[..., dict[str, Tensor]],
                                                        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    data = batch(rows=ROWS)
    pipe = made_up_pipeline(model, example_kwargs={k: v[:PER_STEP] for k, v in data.items()})
    got = _train(pipe, data, tmp_path / "pipe")
    want = _train(plain, data, tmp_path / "plain")
    assert len(got) == len(want) == ROWS // (2 * PER_STEP)
    for g, w in zip(got, want, strict=True):
        assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
        assert_close(g["grad_norm"], w["grad_norm"], rtol=1e-4, atol=1e-6)
    trained = pipe.state_dict()
    for key, value in plain.state_dict().items():
        assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _args(out: Path, **changes: Any) -> Any:
    base: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=PER_STEP, per_device_eval_batch_size=PER_STEP,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, num_train_epochs=1,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **changes})


FAMILIES = pytest.mark.parametrize(("make", "batch"), [(_llama, causal_batch), (_gpt2, causal_batch),
                                                       (_bert, masked_batch)], ids=["llama", "gpt2", "bert"])


@FAMILIES
def test_trainer_evaluates_and_predicts_with_the_pipeline_as_with_the_plain_model(
        make: Callable[[], nn.Module], batch: Callable[..., dict[str, Tensor]], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    rows = batch(rows=ROWS)
    data = _Rows(rows)
    pipe = made_up_pipeline(model, example_kwargs={k: v[:PER_STEP] for k, v in rows.items()})
    got = transformers.Trainer(model=pipe, args=_args(tmp_path / "pipe"), eval_dataset=data)
    want = transformers.Trainer(model=plain, args=_args(tmp_path / "plain"), eval_dataset=data)
    # Trainer finds the labels in the pipeline's signature, so it reports the loss
    assert got.label_names == want.label_names == ["labels"]
    assert_close(got.evaluate()["eval_loss"], want.evaluate()["eval_loss"], rtol=1e-5, atol=1e-6)
    predicted, expected = got.predict(data), want.predict(data)
    assert_close(torch.as_tensor(predicted.predictions), torch.as_tensor(expected.predictions), rtol=1e-4, atol=1e-5)
    assert_close(torch.as_tensor(predicted.label_ids), torch.as_tensor(expected.label_ids))


@FAMILIES
def test_trainer_trains_the_pipeline_under_bf16_as_the_plain_model(
        make: Callable[[], nn.Module], batch: Callable[..., dict[str, Tensor]], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = make()
    plain = copy.deepcopy(model)
    data = batch(rows=ROWS)
    pipe = made_up_pipeline(model, example_kwargs={k: v[:PER_STEP] for k, v in data.items()})
    runs = []
    for m, name in ((pipe, "pipe"), (plain, "plain")):
        # SGD: a weight moves by its gradient, which bf16 rounds differently over micro-batches
        # than over the whole batch; Adam would turn a rounding of a near-zero gradient into lr
        args = _args(tmp_path / name, bf16=True, optim="sgd", learning_rate=0.1)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=_Rows(data))
        trainer.train()
        runs.append([h for h in trainer.state.log_history if "loss" in h])
    got, want = runs
    assert len(got) == len(want) == ROWS // (2 * PER_STEP)
    for g, w in zip(got, want, strict=True):  # the same bf16 ops on the same values
        assert_close(g["loss"], w["loss"], rtol=1e-3, atol=1e-4)
        assert_close(g["grad_norm"], w["grad_norm"], rtol=1e-2, atol=1e-4)
    trained = pipe.state_dict()
    for key, value in plain.state_dict().items():
        assert_close(trained[key], value, rtol=1e-3, atol=1e-4, msg=key)


def test_trainer_checkpoints_the_pipeline_and_resumes_as_an_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _llama()
    start = copy.deepcopy(model)
    data = causal_batch(rows=ROWS)
    example = {k: v[:PER_STEP] for k, v in data.items()}
    pipe = made_up_pipeline(model, example_kwargs=example)
    args = _args(tmp_path / "run", save_strategy="steps", save_steps=1)
    transformers.Trainer(model=pipe, args=args, train_dataset=_Rows(data)).train()
    uninterrupted = {k: v.clone() for k, v in pipe.state_dict().items()}
    # the checkpoint after the first of two steps: the model's weights in the model's own keys
    first = tmp_path / "run" / "checkpoint-1"
    from safetensors.torch import load_file

    saved = load_file(first / "model.safetensors")
    assert set(saved) == set(start.state_dict())
    fresh = made_up_pipeline(copy.deepcopy(start), example_kwargs=example)
    resumed = transformers.Trainer(model=fresh, args=_args(tmp_path / "again"), train_dataset=_Rows(data))
    resumed.train(resume_from_checkpoint=str(first))
    for key, value in fresh.state_dict().items():
        assert_close(value, uninterrupted[key], rtol=0, atol=0, msg=key)
    # save_model writes the pipeline's weights in the plain model's keys: the plain model loads them
    resumed.save_model(str(tmp_path / "final"))
    start.load_state_dict(load_file(tmp_path / "final" / "model.safetensors"))
    for key, value in start.state_dict().items():
        assert_close(value, uninterrupted[key], rtol=0, atol=0, msg=key)


def test_the_pipeline_names_each_stage_s_device_as_huggingface_does(tmp_path: Path) -> None:
    """Trainer and accelerate leave a model alone whose ``hf_device_map`` names two GPUs, and
    move any other onto their device ([Note: a pipeline stays where it was placed])."""
    pipe = made_up_pipeline(_llama(), example_kwargs=causal_batch(rows=PER_STEP))
    assert pipe.hf_device_map == {"stages.0": "cpu", "stages.1": "cpu"}
    trainer = transformers.Trainer(model=pipe, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True), train_dataset=_Rows(causal_batch(rows=ROWS)))
    assert not trainer.is_model_parallel and trainer.model is pipe  # on the CPU: moved to where it is


@skip_if_no_cuda
def test_trainer_moving_a_pipeline_over_a_gpu_and_the_cpu_is_refused_in_one_line(tmp_path: Path) -> None:
    # one GPU in the map: Trainer moves the model onto its device, which would take the CPU stage
    pipe = made_up_pipeline(_llama(), example_kwargs=causal_batch(rows=PER_STEP), devices=("cuda:0", "cpu"))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(ValueError, match=r"^pipe\.to\(\.\.\.\) would move stages on cpu onto cuda:0, but each "
                       r"stage runs on the device the pipeline was built for \(cuda:0, cpu\)"):
        transformers.Trainer(model=pipe, args=args, train_dataset=_Rows(causal_batch(rows=ROWS)))
