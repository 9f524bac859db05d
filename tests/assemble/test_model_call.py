"""[Note: the model's call] (autopipe/assemble/local.py): a pipeline's forward names the traced
inputs as HuggingFace's Trainer reads a model's signature, and takes ``num_items_in_batch`` as
HF's models do: the loss of batches accumulated over one step equals the plain model's."""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autopipe
from executor.errors import MicroBatchError
from tests.assemble.test_hf_batches import _llama, causal_batch
from tests.assemble.test_local import made_up_pipeline


@functools.cache
def _llama_pipeline() -> tuple[autopipe.Pipeline, nn.Module]:
    """A 2-stage pipeline of the seeded Llama (made-up costs: no profiling) and a deep copy of the
    model; the tests only read the weights, and zero the gradients they make."""
    torch.manual_seed(0)
    model = _llama()
    reference = copy.deepcopy(model)
    return made_up_pipeline(model, example_kwargs=causal_batch()), reference


def test_forward_names_the_traced_inputs_as_trainer_reads_them() -> None:
    pipe, _ = _llama_pipeline()
    signature = inspect.signature(pipe.forward)  # what Trainer's remove_unused_columns keeps
    assert list(signature.parameters) == ["input_ids", "attention_mask", "labels", "num_items_in_batch"]
    assert pipe.accepts_loss_kwargs  # Trainer then passes num_items_in_batch

    ex = autopipe.get_example("mlp", batch_size=8)
    own = made_up_pipeline(ex.model, ex.inputs, loss_fn=F.cross_entropy)
    assert str(inspect.signature(own.forward)) == "(input_0, /, *, target)" and not own.accepts_loss_kwargs
    assert_close(own(*ex.inputs, target=ex.target), F.cross_entropy(ex.model(*ex.inputs), ex.target))


def test_batches_accumulated_over_num_items_equal_the_plain_model() -> None:
    """Two batches of one step, each loss over the items both count (Trainer's gradient
    accumulation): the losses and the summed gradients are the plain model's."""
    pipe, reference = _llama_pipeline()
    first = causal_batch()
    second = {k: v.roll(3, dims=0) for k, v in causal_batch(rows=8, length=8).items()}
    second["labels"][:, 5:] = -100  # fewer items than the first: a mean of the two means is wrong
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in (first, second))
    pipe.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    for batch in (first, second):
        got = pipe(**batch, num_items_in_batch=items).loss
        want = reference(**batch, num_items_in_batch=items).loss
        assert_close(got, want)
        got.backward()
        want.backward()
    trained = pipe.state_dict(keep_vars=True)  # the model's keys
    for name, param in reference.named_parameters():
        assert_close(trained[name].grad, param.grad, msg=name)
    pipe.zero_grad(set_to_none=True)


@pytest.mark.parametrize("items", [0, -3])
def test_num_items_that_count_nothing_are_one_line(items: int) -> None:
    pipe, _ = _llama_pipeline()
    with pytest.raises(MicroBatchError, match=rf"^num_items_in_batch={float(items)}: the items counted over the "
                                            r"accumulated batches must be positive$"):
        pipe(**causal_batch(), num_items_in_batch=items)
