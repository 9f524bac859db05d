"""trace(..., example_kwargs=): batched keyword tensors are graph inputs, the rest constants,
and a loss the model computes is found with a count of its target items."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopipe.errors import TraceError
from autopipe.frontend.tracing.graph import LayerGraph, trace


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 5)

    def forward(self, x: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                labels: Tensor | None = None) -> tuple[Tensor, Tensor] | Tensor:
        logits = self.proj(x) * scale
        if mask is not None:
            logits = logits * mask[..., None]
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 5), labels[:, 1:].reshape(-1)), logits


X = torch.randn(3, 6, 4)
MASK = torch.ones(3, 6)
LABELS = torch.tensor([[1, 2, -100, 3, 4, 0]] * 3)


@pytest.fixture(scope="module")
def graph() -> LayerGraph:  # given out of the signature's order, with constants among them
    return trace(Tagger(), (X,), example_kwargs={"labels": LABELS, "scale": 2.0, "mask": MASK})


def test_batched_keywords_follow_the_positional_inputs_in_signature_order(graph: LayerGraph) -> None:
    assert graph.source == "fx"  # a constant kwarg (scale=2.0) no longer sends it to torch.export
    assert graph.keywords == ("mask", "labels")
    assert graph.num_args == 3
    assert graph.input_names[:3] == ["x", "mask", "labels"]
    assert graph.kwargs == {"scale": 2.0}  # a non-tensor stays a constant


def test_the_models_loss_is_counted_after_its_label_shift(graph: LayerGraph) -> None:
    assert graph.loss is not None and graph.loss.leaf == 0 and graph.loss.ignore_index == -100
    assert int(graph.loss.count(X, MASK, LABELS)) == int((LABELS[:, 1:] != -100).sum()) == 12


def test_a_keyword_in_kwargs_and_example_kwargs_is_refused() -> None:
    with pytest.raises(TraceError, match=r"^'mask' is in both example_kwargs and kwargs: pass it once"):
        trace(Tagger(), (X,), example_kwargs={"mask": MASK}, kwargs={"mask": None})
