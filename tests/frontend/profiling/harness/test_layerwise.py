"""autopipe.frontend.profiling.harness.layerwise: every layer alone on the device, identical layers measured once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.examples import TinyGPT
from autopipe.frontend.profiling.harness.layerwise import layer_by_layer
from autopipe.frontend.profiling.harness.replay import graph_args, layer_calls, record_values
from autopipe.frontend.tracing.graph import trace
from tests.models import Chain, tiny_llama


def _forward_backward(run: object) -> None:
    call, values = run.call, run.values  # type: ignore[attr-defined]
    out = call.module(*call.arguments(values))
    leaves = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


@pytest.mark.compat
def test_a_meta_model_runs_layer_by_layer_and_stays_meta() -> None:
    with torch.device("meta"):
        model = TinyGPT(layers=3)
    ids = torch.randint(0, 256, (2, 16))
    g = trace(model, (ids,))
    runs = list(layer_by_layer(g, (ids,), "cpu"))
    assert [r.call.name for r in runs] == g.layers
    measured = [r for r in runs if r.reuse_of is None]
    reused = {r.call.name: r.reuse_of for r in runs if r.reuse_of is not None}
    # the blocks after the first are the first block's twins
    assert reused["blocks.2.qkv"] == reused["blocks.1.qkv"] == "blocks.0.qkv"
    assert len(measured) < len(runs) / 2
    for run in measured:
        tensors = [*run.call.module.parameters(), *run.call.module.buffers()]
        assert all(t.device.type == "cpu" for t in tensors), run.call.name
        _forward_backward(run)
    assert all(p.is_meta for p in model.parameters())  # nothing of the model was allocated
    embedding = next(r for r in runs if r.call.name == "tok")
    ids_in = embedding.call.arguments(embedding.values)[0]
    assert torch.equal(ids_in, ids)  # the model's own inputs, so token ids stay in range


def test_a_real_layer_is_copied_not_shared() -> None:
    model = Chain()
    x = torch.randn(4, 8)
    g = trace(model, (x,))
    values = record_values(g.gm, graph_args(g, (x,)))
    originals = {c.name: c for c in layer_calls(g)}
    for run in layer_by_layer(g, (x,), "cpu", dedupe=False):
        assert run.reuse_of is None
        own = {p.data_ptr() for p in run.call.module.parameters()}
        assert not own & {p.data_ptr() for p in model.parameters()}
        original = originals[run.call.name]
        args = original.arguments(values)
        torch.testing.assert_close(run.call.module(*args), original.module(*args))


def test_layers_of_other_shapes_are_not_twins() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    runs = list(layer_by_layer(trace(model, (x,)), (x,), "cpu"))
    twins = [r.reuse_of for r in runs]
    # layer 0 reads the model's input (and may hold a check of its shape, then 1 is measured)
    assert twins[0] is None and twins[1] in (None, "0") and twins[2] == (twins[1] or "1")
    assert twins[3] is None  # another output shape


@pytest.mark.compat
def test_a_meta_export_graph_runs_on_a_real_device() -> None:
    model = tiny_llama(meta=True)
    ids = torch.randint(0, 64, (2, 8))
    g = trace(model, (ids,))
    assert g.source == "export"  # it bakes device=meta into factory calls: they must be moved
    runs = list(layer_by_layer(g, (ids,), "cpu"))
    assert sum(r.reuse_of is None for r in runs) < len(runs)
    for run in runs:
        if run.reuse_of is None:
            _forward_backward(run)
