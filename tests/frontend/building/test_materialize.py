"""autopipe.frontend.building.materialize: meta-built stages made real one at a time, from weights or init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.building.materialize import (
    TensorIndex,
    has_meta_tensors,
    materialize,
    materialize_stages,
)
from autopipe.frontend.building.stages import split_stages
from autopipe.frontend.building.weights import match_weights, open_weights
from autopipe.frontend.tracing.graph import trace


def _gpt_pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    real = TinyGPT(layers=2)
    with torch.device("meta"):
        meta = TinyGPT(layers=2)
    return real, meta, torch.randint(0, 256, (4, 16))


def _stages(model: nn.Module, ids: torch.Tensor, k: int) -> list[torch.fx.GraphModule]:
    g = trace(model, (ids[:2],))
    n = len(g.layers)
    cuts = [round(i * n / k) for i in range(k + 1)]
    return split_stages(g, [g.layers[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])


def _run(stages: list[torch.fx.GraphModule], ids: torch.Tensor) -> torch.Tensor:
    value: object = ids
    for s in stages:
        value = s(*value) if isinstance(value, tuple) else s(value)
    assert isinstance(value, torch.Tensor)
    return value


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "mapping"])
def test_meta_stages_from_weights_equal_the_real_model(tmp_path: Path, fmt: str) -> None:
    real, meta, ids = _gpt_pair()
    state = {k: v.clone() for k, v in real.state_dict().items()}
    del state["head.weight"]  # stored once, as HuggingFace stores a tied head
    if fmt == "safetensors":
        save_file(state, str(tmp_path / "w.safetensors"))
        weights: object = tmp_path / "w.safetensors"
    elif fmt == "torch":
        torch.save(state, tmp_path / "w.pt")
        weights = tmp_path / "w.pt"
    else:
        weights = state
    stages = _stages(meta, ids, 3)
    index = TensorIndex.build(meta, stages)
    source = open_weights(weights)  # type: ignore[arg-type]
    key_map = match_weights(source, index.expected(meta), index.aliases())
    for stage in stages:
        assert materialize(stage, "cpu", index=index, weights=source, key_map=key_map) == []
    assert not any(has_meta_tensors(s) for s in stages) and not has_meta_tensors(meta)
    assert meta.head.weight is meta.tok.weight  # the tie is still one Parameter
    out = _run(stages, ids)
    ref = real(ids)
    torch.testing.assert_close(out, ref)
    out.float().pow(2).mean().backward()
    ref.float().pow(2).mean().backward()
    grads = dict(meta.named_parameters())
    for name, p in real.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    for key, value in real.state_dict().items():
        torch.testing.assert_close(meta.state_dict()[key], value)


def _gpt_init(module: nn.Module) -> None:
    if isinstance(module, TinyGPT):  # its own raw parameter: the position embedding
        nn.init.normal_(module.pos, std=0.02)
    else:
        module.reset_parameters()  # type: ignore[operator]


def test_init_is_seeded_per_module_whatever_the_split() -> None:
    _, meta_a, ids = _gpt_pair()
    with torch.device("meta"):
        meta_b = TinyGPT(layers=2)
    results = []
    for model, k in ((meta_a, 2), (meta_b, 3)):
        stages = _stages(model, ids, k)
        index = TensorIndex.build(model, stages)
        inited = [name for s in stages
                  for name in materialize(s, "cpu", index=index, init=_gpt_init, seed=7)]
        assert {"", "blocks.0.qkv", "tok"} <= set(inited)
        results.append(model.state_dict())
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, msg=key)
    assert results[0]["blocks.0.qkv.weight"].std() > 0  # initialised, not left empty


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = _NoReset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_a_module_without_reset_parameters_needs_init() -> None:
    with torch.device("meta"):
        model = _Scaled()
    stages = _stages(model, torch.randn(4, 4, device="meta"), 1)
    index = TensorIndex.build(model, stages)
    with pytest.raises(BuildError, match=r"module 'norm' \(_NoReset\) has tensors on the meta device "
                                         r"and no reset_parameters\(\); pass init=fn"):
        materialize(stages[0], "cpu", index=index)

    def init(module: nn.Module) -> None:
        if isinstance(module, _NoReset):
            nn.init.constant_(module.scale, 2.0)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    assert materialize(stages[0], "cpu", index=index, init=init) == ["lin", "norm"]
    torch.testing.assert_close(model.norm.scale, torch.full((4,), 2.0))


class _NoGradPositions(nn.Module):
    """A ``@torch.no_grad()`` helper that makes a tensor on its input's device, as transformers
    5.17's rotary embedding does: torch.export writes the helper's body as a graph of its own
    (``wrap_with_set_grad_enabled(False, submod_1, ...)``) with the meta device baked in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.no_grad()
    def positions(self, x: torch.Tensor) -> torch.Tensor:
        # len() stops torch.fx, as HF models' code does: the graph comes from torch.export
        return torch.arange(x.shape[-1], device=x.device, dtype=x.dtype) / len(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.positions(x)


def _meta_devices(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes, in ``gm`` and every graph nested in it, that name the meta device."""
    found = []
    for path, sub in gm.named_modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                values = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: v)
                if "device(type='meta')" in repr(values):
                    found.append(f"{path or '<top>'}.{node.name}")
    return found


def test_nested_graphs_of_a_meta_model_run_on_the_device_and_the_trace_keeps_meta() -> None:
    torch.manual_seed(0)
    real = _NoGradPositions()
    with torch.device("meta"):
        meta = _NoGradPositions()
    x = torch.randn(2, 4)
    g = trace(meta, (x,))
    assert g.source == "export"
    nested = [p for p in _meta_devices(g.gm) if not p.startswith("<top>")]
    assert nested, "the no_grad helper's body is a graph of its own that names the meta device"
    stages = split_stages(g, [g.layers])
    materialize_stages(meta, stages, ["cpu"], weights={k: v.clone() for k, v in real.state_dict().items()})
    assert _meta_devices(stages[0]) == []  # retargeted, nested bodies included
    assert [p for p in _meta_devices(g.gm) if not p.startswith("<top>")] == nested  # shared, kept
    torch.testing.assert_close(_run(stages, x), real(x))
