"""``profile(model, example_kwargs=batch)``: an HF batch profiled as the pipelines take it, so
that profile -> partition -> ``pipeline(plan=)`` is written for an HF model without tracing by
hand (issue 42)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import autopipe
from autopipe.errors import ProfileError
from tests.assemble.test_hf_batches import _llama, causal_batch

transformers = pytest.importorskip("transformers")


def test_an_hf_batch_profiles_partitions_and_builds_the_pipeline_of_its_plan() -> None:
    torch.manual_seed(0)
    model, batch = _llama(), causal_batch()
    plain = copy.deepcopy(model)
    prof = autopipe.profile(model, example_kwargs=batch, chunks=2, repeats=1, warmup=0)
    assert prof.meta["batch_size"] == 8 and prof.meta["micro_batch_size"] == 4
    plan = autopipe.partition(prof, devices=["cpu", "cpu"], chunks=2)
    # the plan's fingerprint is the pipeline's own trace of the same batch: it is taken as it is
    pipe = autopipe.pipeline(model, example_kwargs=batch, plan=plan, devices=["cpu", "cpu"])
    assert pipe.plan.stages == plan.stages
    out, want = pipe(**batch), plain(**batch)
    assert_close(out.loss, want.loss)
    assert_close(out.logits, want.logits)


def test_keyword_inputs_reach_the_whole_model_steps() -> None:
    # the loss's timing runs the whole model on the profiled batch: its keyword inputs by name
    torch.manual_seed(0)
    model, batch = _llama(), causal_batch()
    labels = batch.pop("labels")

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten(), ignore_index=-100)

    prof = autopipe.profile(model, example_kwargs=batch, chunks=2, repeats=1, warmup=0,
                            loss_fn=loss_fn, target=labels)
    assert prof.corrections.loss is not None and prof.corrections.loss.micro_batch_size == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"example_kwargs": [torch.zeros(2, 3)]}, "example_kwargs must be a mapping of keyword inputs"),
    ({"example_kwargs": {"use_cache": False}}, "holds no tensor with a batch dimension"),
    ({"example_kwargs": {"input_ids": [torch.zeros(2, 3, dtype=torch.long)]}},
     r"example_kwargs\['input_ids'\] holds batched tensors inside a list"),
])
def test_bad_keyword_batches_are_one_line_profile_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ProfileError, match=match) as err:
        autopipe.profile(_llama(), repeats=1, warmup=0, **kwargs)
    assert "\n" not in str(err.value)
