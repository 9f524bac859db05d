from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autopipe
from autopipe import TraceError
from autopipe.examples import TinyGPT, UnevenMLP, get_example
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.frontend.tracing.grouping import is_cheap
from tests.models import Chain, MultiIO, Skip, Untraceable, tiny_gpt2


def model_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # dedups tied params


def check_invariants(g: LayerGraph, model: nn.Module) -> None:
    assert g.param_bytes == model_param_bytes(model)
    assert list(g.nx.nodes) == g.layers or set(g.nx.nodes) == set(g.layers)
    assert len(set(g.layers)) == len(g.layers)
    order = {n: i for i, n in enumerate(g.layers)}
    for u, v in g.nx.edges:
        assert order[u] < order[v], f"edge {u}->{v} goes backwards in the layer order"
    # every computing node belongs to exactly one layer
    for node in g.gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            assert node.name in g.node_layer


@pytest.mark.parametrize(
    "name,lo,hi", [("mlp", 10, 20), ("cnn", 20, 45), ("gpt", 30, 70), ("unet", 12, 25)]
)
@pytest.mark.compat
def test_bundled_examples(name: str, lo: int, hi: int) -> None:
    ex = get_example(name, batch_size=4)
    g = trace(ex.model, ex.inputs)
    assert g.source == "fx"
    assert lo <= len(g) <= hi, g.layers
    check_invariants(g, ex.model)
    # no layer consists only of cheap ops (views, getattr, shape arithmetic)
    by_name = {n.name: n for n in g.gm.graph.nodes}
    for layer in g.layers:
        nodes = [by_name[n] for n in g.nx.nodes[layer]["nodes"] if by_name[n].op != "get_attr"]
        assert not all(is_cheap(n) for n in nodes), layer


def test_mlp_edge_bytes_and_chain() -> None:
    ex = get_example("mlp", batch_size=8)
    g = trace(ex.model, ex.inputs)
    assert g.is_chain()
    assert g.layers[0] == "net.0"
    # net.0 maps 64 -> 512 features: 8 rows x 512 floats cross the first edge
    assert g.nx.edges["net.0", "net.1"]["bytes"] == 8 * 512 * 4
    assert g.layer("net.0")["output_shapes"] == [[8, 512]]
    assert g.layer("net.0")["param_bytes"] == (64 * 512 + 512) * 4
    assert g.input_bytes == 8 * 64 * 4
    assert g.edges()[0] == ("net.0", "net.1", 8 * 512 * 4)


def test_gpt_tie_group_counted_once() -> None:
    ex = get_example("gpt", batch_size=2)
    g = trace(ex.model, ex.inputs)
    assert g.tie_groups == {"tok.weight": ["tok", "head"]}
    tok, head = g.layer("tok"), g.layer("head")
    assert tok["param_bytes"] == 256 * 64 * 4 and tok["shared_bytes"] == 0
    assert head["param_bytes"] == 0 and head["shared_bytes"] == 256 * 64 * 4
    assert tok["tie_group"] == head["tie_group"] == "tok.weight"


def test_unet_skip_edges() -> None:
    ex = get_example("unet", batch_size=2)
    g = trace(ex.model, ex.inputs)
    assert not g.is_chain()
    # enc1's output feeds the last concatenation directly: a long skip
    assert g.nx.has_edge("enc1.1", "cat_1")
    assert g.nx.edges["enc1.1", "cat_1"]["bytes"] == 2 * 8 * 32 * 32 * 4


def test_fingerprint_stable_and_sensitive() -> None:
    a = trace(get_example("gpt", 2).model, get_example("gpt", 2).inputs)
    b = trace(get_example("gpt", 2, seed=1).model, get_example("gpt", 2, seed=1).inputs)
    assert a.fingerprint == b.fingerprint  # same structure and shapes, other weights
    c = trace(get_example("gpt", 3).model, get_example("gpt", 3).inputs)
    assert c.fingerprint != a.fingerprint  # batch shape changed
    d = trace(TinyGPT(layers=3), get_example("gpt", 2).inputs)
    assert d.fingerprint != a.fingerprint  # model changed
    e = trace(UnevenMLP(), (torch.randn(2, 64, dtype=torch.float64),))
    f = trace(UnevenMLP(), (torch.randn(2, 64),))
    assert e.fingerprint != f.fingerprint  # dtype changed


def test_graph_module_computes_the_model() -> None:
    ex = get_example("cnn", batch_size=3)
    g = trace(ex.model, ex.inputs)
    torch.testing.assert_close(g.gm(*ex.inputs), ex.model(*ex.inputs))
    # the GraphModule shares the model's parameters (no copies)
    assert g.gm.get_parameter("stem.weight") is ex.model.stem.weight


def test_max_depth_and_leaf_modules() -> None:
    ex = get_example("gpt", batch_size=2)
    g = trace(ex.model, ex.inputs, max_depth=2)
    assert g.layers == ["tok", "add", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]
    assert g.is_chain()
    check_invariants(g, ex.model)
    by_type = trace(ex.model, ex.inputs, leaf_modules=[type(ex.model.blocks[0])])
    assert [n for n in by_type.layers if n.startswith("blocks")] == [f"blocks.{i}" for i in range(4)]
    by_name = trace(ex.model, ex.inputs, leaf_modules=["blocks.1"])
    assert "blocks.1" in by_name.layers and "blocks.0" not in by_name.layers
    assert by_name.layer("blocks.1")["kind"] == "module"
    assert by_name.layer("blocks.1")["module_type"] == "Block"


def test_non_tensor_values_and_dict_outputs() -> None:
    model = MultiIO()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    g = trace(model, (x, y))
    assert g.input_names == ["x", "y"] and g.input_bytes == 2 * 4 * 8 * 4
    assert g.layers == ["x_proj", "y_proj", "add", "out"]
    out = g.gm(x, y)
    assert set(out) == {"logits", "hidden"}
    torch.testing.assert_close(out["logits"], model(x, y)["logits"])


def test_skip_connection_edges() -> None:
    g = trace(Skip(), (torch.randn(4, 8),))
    assert g.nx.has_edge("a", "add")  # h skips over b and c
    assert not g.is_chain()


def test_traces_meta_model_without_real_memory() -> None:
    model = Chain((8, 4096, 4096, 8)).to("meta")
    g = trace(model, (torch.empty(16, 8, device="meta"),))
    assert g.param_bytes == model_param_bytes(model)
    assert g.nx.edges["net.0", "net.1"]["bytes"] == 16 * 4096 * 4


@pytest.mark.slow
def test_torch_transformer_models() -> None:
    t = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1,
                       dim_feedforward=64, batch_first=True)
    g = trace(t, (torch.randn(2, 10, 32), torch.randn(2, 7, 32)))
    assert 30 <= len(g) <= 80
    check_invariants(g, t)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 3,
                                enable_nested_tensor=False)
    ge = trace(enc, (torch.randn(2, 10, 32),))
    check_invariants(ge, enc)
    assert trace(enc, (torch.randn(2, 10, 32),), max_depth=2).layers == [
        "layers.0", "layers.1", "layers.2"
    ]


@pytest.mark.slow
@pytest.mark.compat
def test_huggingface_gpt2_from_config() -> None:
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = trace(model, (ids,))
        coarse = trace(model, (ids,), max_depth=3)
    assert g.source == "export"  # torch.fx cannot trace HF GPT-2; the fallback did
    check_invariants(g, model)
    assert g.tie_groups["transformer.wte.weight"] == ["transformer.wte", "lm_head"]
    assert {"transformer.h.0", "transformer.h.1", "lm_head"} <= set(coarse.layers)
    assert len(coarse) < len(g) <= 60
    assert coarse.fingerprint != g.fingerprint
    # the batch dimension stays dynamic, so micro-batches of any size run through the graph
    torch.testing.assert_close(g.gm(ids[:1], use_cache=False).logits, model(ids[:1]).logits)
    assert g.num_args == 1 and g.input_names == ["input_ids", "use_cache"]


@pytest.mark.compat
def test_untraceable_model_names_construct_and_fix() -> None:
    with pytest.raises(TraceError, match=r"the model's own forward at tests/models.py:\d+ .*"
                                         r"Remove the data-dependent Python control flow") as info:
        trace(Untraceable(), (torch.randn(2, 4),))
    assert "\n" not in str(info.value)
    assert "Untraceable" in str(info.value)
    assert "leaf_modules" not in str(info.value)  # the root is no module one can mark a leaf


def test_leaf_module_makes_untraceable_submodule_traceable() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(4, 4)
            self.inner = Untraceable()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.pre(x))

    with pytest.raises(TraceError, match="module 'inner'"):
        trace(Wrapper(), (torch.randn(2, 4),))
    g = trace(Wrapper(), (torch.randn(2, 4),), leaf_modules=["inner"])
    assert g.layers == ["pre", "inner"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_depth": 0}, "max_depth must be >= 1"),
        ({"leaf_modules": [3]}, "leaf_modules entries"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(TraceError, match=match):
        trace(Chain(), (torch.randn(2, 8),), **kwargs)  # type: ignore[arg-type]


def test_not_a_module() -> None:
    with pytest.raises(TraceError, match="needs an nn.Module"):
        trace(lambda x: x, (torch.randn(2),))  # type: ignore[arg-type]


def test_wrong_input_shape_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match="cannot trace UnevenMLP"):
        trace(UnevenMLP(), (torch.randn(2, 3),))


def test_public_surface() -> None:
    assert autopipe.trace is trace and "trace" in autopipe.__all__
    assert "LayerGraph(" in repr(trace(Chain(), (torch.randn(2, 8),)))
    assert "net.0" in trace(Chain(), (torch.randn(2, 8),)).summary()


class _FloatLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.a(x))).float()  # fp32 already: the same memory
        return logits, logits.logsumexp(-1)


def test_what_the_model_returns_is_charged_to_the_layer_that_made_its_memory() -> None:
    # [Note: receive buffers]: a last stage starting at the no-op .float() receives the logits
    g = trace(_FloatLogits(), (torch.randn(2, 4),))
    returned = {n: d["returned_bytes"] for n, d in g.nx.nodes(data=True)}
    float_layer = next(n for n in returned if n.startswith("float"))
    assert returned["head"] == 2 * 6 * 4 and returned[float_layer] == 0
    assert returned["logsumexp"] == 2 * 4 and sum(returned.values()) == 2 * 6 * 4 + 2 * 4
