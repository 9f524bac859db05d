"""trace(..., example_kwargs=): batched keyword tensors are graph inputs, the rest constants,
and a loss the model computes is found with a count of its target items."""

from __future__ import annotations

import re

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


class OwnLoss(nn.Module):
    """A loss the model computes that autopipe cannot count per item, unless ``kind="mean"``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.teacher = nn.Linear(4, 3), nn.Linear(4, 3)
        self.register_buffer("w", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.a(x)
        if self.kind == "weight":
            return F.cross_entropy(logits, labels, weight=self.w), logits
        if self.kind == "sum":
            return F.cross_entropy(logits, labels, reduction="sum"), logits
        if self.kind == "teacher":
            return F.cross_entropy(logits, self.teacher(x).argmax(-1)), logits
        return F.cross_entropy(logits, labels), logits


@pytest.mark.parametrize(("kind", "why"), [
    ("weight", r"has class weights \(weight=\)"), ("sum", r"has reduction='sum'"),
    ("teacher", r"has a target its layers compute, not one of its inputs"), ("mean", None)])
def test_a_loss_that_cannot_be_counted_is_weighted_by_rows_with_one_warning(kind: str, why: str | None) -> None:
    import warnings

    from autopipe.assemble.local import pipeline
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile

    batch = {"x": torch.randn(6, 4), "labels": torch.tensor([0, 1, 2, 0, 1, 2])}
    model = OwnLoss(kind)
    graph = trace(model, (), example_kwargs={k: v[:3] for k, v in batch.items()})
    plan = partition(cost_profile(graph), devices=["cpu"] * 2, method="dp", chunks=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = pipeline(model, example_kwargs=batch, devices=["cpu"] * 2, chunks=2, plan=plan,
                        graph=graph)
    lines = [str(w.message) for w in caught if "loss" in str(w.message)]
    assert (graph.loss is None) == (why is not None)
    if why is None:
        assert lines == []
        return
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert re.match(rf"^autopipe: the model's loss \(output leaf 0\) {why}, which cannot be counted "
                    r"per item: each micro-batch's loss is weighted by its share of rows.*loss_fn=$",
                    lines[0])
    with torch.no_grad():  # as it says: the mean of the two micro-batches' own losses
        halves = [model(**{k: v[s] for k, v in batch.items()})[0] for s in (slice(0, 3), slice(3, 6))]
        assert torch.allclose(pipe(**batch)[0], torch.stack(halves).mean())
