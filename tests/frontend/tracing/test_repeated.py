"""trace(repeated=True): a stack of identical blocks traced on two and three of them and the rest
repeated ([Note: repeated blocks]). The truth each test controls is the full trace of the same
model: the grown capture must be it (same_capture), node for node, and so must the LayerGraph
and the estimated profile made from it; where the blocks are not repeats, it is what runs."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopipe.frontend.profiling.profiler import profile
from autopipe.frontend.tracing import graph as graph_module
from autopipe.frontend.tracing.capture import Capture, capture
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.frontend.tracing.repeated import Blocks, capture_repeated, find_blocks, same_capture


class Block(nn.Module):
    def __init__(self, width: int, index: int, p: float = 0.25, extra_after: int | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.layer_idx = index  # counts with the block: still a repeat
        self.p = p
        self.extra_after = extra_after

    def forward(self, x: Tensor) -> Tensor:
        out = x + F.dropout(torch.relu(self.fc(x)), self.p, self.training)  # a by_mode literal each
        if self.extra_after is not None and self.layer_idx >= self.extra_after:
            out = out * 2  # the forward branches on the block's index
        return out


class Stack(nn.Module):
    def __init__(self, n: int = 7, width: int = 8, blocks: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(blocks if blocks is not None else [Block(width, i) for i in range(n)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _both(model: nn.Module, inputs: tuple[Any, ...], **kwargs: Any) -> tuple[Capture | str, Capture]:
    def whole() -> Capture:
        return capture(model, inputs, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture_repeated(model, whole), whole()


def _same_graph(x: LayerGraph, y: LayerGraph) -> None:
    assert x.fingerprint == y.fingerprint
    assert x.layers == y.layers and x.node_layer == y.node_layer and x.grouped == y.grouped
    assert dict(x.nx.nodes(data=True)) == dict(y.nx.nodes(data=True))
    assert x.edges() == y.edges() and x.input_names == y.input_names and x.input_bytes == y.input_bytes


def test_a_torch_fx_stack_grown_from_two_blocks_is_its_full_trace() -> None:
    model = Stack(7)
    grown, full = _both(model, (torch.randn(3, 4),))
    assert isinstance(grown, Capture), grown
    assert full.source == "fx" and full.modes.selected == 7  # one by_mode per block's dropout
    assert same_capture(grown, full) == ""
    assert [n.name for n in grown.gm.graph.nodes] == [n.name for n in full.gm.graph.nodes]
    x = torch.randn(3, 4)
    torch.testing.assert_close(grown.gm.eval()(x), model.eval()(x))


def test_trace_repeated_gives_the_full_trace_s_layer_graph() -> None:
    model, x = Stack(8), torch.randn(3, 4)
    _same_graph(trace(model, (x,), repeated=True), trace(model, (x,)))


def test_same_capture_names_a_difference() -> None:
    x = torch.randn(3, 4)
    seven, eight = capture(Stack(7), (x,)), capture(Stack(8), (x,))
    assert same_capture(seven, eight) == "the graphs' code differs"
    model = Stack(7)
    first, second = capture(model, (x,)), capture(model, (x,))
    assert same_capture(first, second) == ""
    node = next(n for n in second.gm.graph.nodes if n.name == "relu_3")
    node.meta["val"] = torch.empty(5, 5)
    assert same_capture(first, second) == "node relu_3's val"


def test_find_blocks_takes_the_outermost_stack_of_repeats() -> None:
    assert find_blocks(Stack(7)) == Blocks("blocks", 7)
    assert find_blocks(Stack(5)) is None  # fewer than MIN_BLOCKS: the full trace costs no more
    assert find_blocks(Stack(5), minimum=4) == Blocks("blocks", 5)
    assert find_blocks(nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])) is None  # the model itself


@pytest.mark.parametrize("differ", ["width", "setting", "hook"])
def test_blocks_that_differ_are_not_repeats(differ: str) -> None:
    blocks: list[nn.Module] = [Block(8, i) for i in range(7)]
    if differ == "width":
        blocks[5].fc = nn.Linear(8, 8, bias=False)
    elif differ == "setting":
        blocks[5].p = 0.5  # type: ignore[assignment]
    else:
        blocks[5].register_forward_hook(lambda *_: None)
    model = Stack(blocks=blocks)
    assert find_blocks(model) is None
    grown, full = _both(model, (torch.randn(3, 4),))
    assert grown == "no stack of 6 or more identical blocks"


def test_a_branch_on_the_index_within_three_blocks_falls_back_to_the_full_trace() -> None:
    model, x = Stack(blocks=[Block(8, i, extra_after=2) for i in range(7)]), torch.randn(3, 4)
    grown, _ = _both(model, (x,))
    assert grown == "3 blocks trace to 22 nodes, 2 grown to 21"  # block 2 doubles its output
    _same_graph(trace(model, (x,), repeated=True), trace(model, (x,)))


def test_a_branch_on_the_index_past_the_third_block_is_not_seen() -> None:
    """The blind spot the Note names: why trace() repeats only when asked."""
    model = Stack(blocks=[Block(8, i, extra_after=5) for i in range(7)])
    grown, full = _both(model, (torch.randn(3, 4),))
    assert isinstance(grown, Capture)
    assert same_capture(grown, full) == "the graphs' code differs"


def test_the_model_keeps_its_blocks_when_a_cut_trace_fails() -> None:
    class Indexed(Stack):
        def forward(self, x: Tensor) -> Tensor:  # reads block 5 by index: no trace of 2 blocks
            h = self.embed(x)
            for i in range(7):
                h = self.blocks[i](h)
            return self.head(h)

    model = Indexed(7)
    blocks = model.blocks
    grown, full = _both(model, (torch.randn(3, 4),))
    assert isinstance(grown, str) and "index" in grown
    assert model.blocks is blocks and len(model.blocks) == 7
    assert full.source == "fx"


def test_no_stack_of_blocks_traces_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    grown, _ = _both(model, (x,))
    assert grown == "no stack of 6 or more identical blocks"
    calls: list[bool] = []
    monkeypatch.setattr(graph_module, "capture_repeated", lambda *a, **k: calls.append(True) or "")
    trace(model, (x,))
    assert calls == []  # only when asked


def test_an_estimate_traces_repeated_and_equals_the_full_trace_s(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = Stack(7), torch.randn(4, 4)
    full = profile(model, (x,), chunks=2, graph=trace(model, (x[:2],)), estimate="h100", progress=False)
    seen: list[Capture | str] = []
    real = graph_module.capture_repeated

    def spy(*args: Any, **kwargs: Any) -> Capture | str:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(graph_module, "capture_repeated", spy)
    fast = profile(model, (x,), chunks=2, estimate="h100", progress=False)
    assert len(seen) == 1 and isinstance(seen[0], Capture)
    assert fast.df.equals(full.df)
    assert {k: v for k, v in fast.meta.items() if k != "date"} == {k: v for k, v in full.meta.items() if k != "date"}


def test_hf_llama_grown_from_two_blocks_is_its_full_export() -> None:
    """torch.export's graph of HF Llama on meta: sizes symbolic, names counted across the whole
    graph (a size node at the top numbered after every block), the attention's dropout bound to
    the mode in every block, the head tied to the embedding; the 6 blocks grown from 2 must be
    the full export's, node for node (the one HF model here: 4 cut exports and 2 whole ones)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attention_dropout=0.1, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    grown, full = _both(model, (torch.randint(0, 64, (2, 8)),))
    assert isinstance(grown, Capture), grown
    assert full.source == "export" and full.modes.selected == 6  # the attention's dropout_p, each block
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert same_capture(grown, full) == ""
