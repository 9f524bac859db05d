"""accelerate's Accelerator prepares a one-process pipeline as it prepares the plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from tests.assemble.test_hf_batches import _llama, causal_batch
from tests.assemble.test_local import made_up_pipeline

accelerate = pytest.importorskip("accelerate")


def _train(model: nn.Module, rows: list[dict[str, torch.Tensor]]) -> list[float]:
    """accelerate's loop: prepare, forward, accelerator.backward, clip, step."""
    acc = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    prepared, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        out = prepared(**batch)
        acc.backward(out.loss)
        acc.clip_grad_norm_(prepared.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


def test_accelerator_prepares_and_trains_a_pipeline_as_the_plain_model() -> None:
    torch.manual_seed(0)
    model = _llama()
    plain = copy.deepcopy(model)
    data = causal_batch(rows=12)
    rows = [{k: v[i] for k, v in data.items()} for i in range(12)]
    pipe = made_up_pipeline(model, example_kwargs={k: v[:4] for k, v in data.items()})
    got, want = _train(pipe, rows), _train(plain, rows)
    assert len(got) == 3
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    trained = pipe.state_dict()
    for key, value in plain.state_dict().items():
        assert_close(trained[key], value, rtol=1e-5, atol=1e-6, msg=key)
