"""The sequence nodes found in traced models ([Note: sequence nodes]): the norms, residual adds and
dropout between groups are ``sequence``, ops that mix, drop or reshape tokens are not."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from autopipe.examples import TinyGPT
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.frontend.tracing.tensor_parallel import tensor_parallel_nodes

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _sequence_layers(g: LayerGraph) -> set[str]:
    return {n for n in g.layers if g.nx.nodes[n]["tp_role"] == "sequence"}


def _sequence_nodes(g: LayerGraph) -> set[str]:
    return {n for n, (role, _) in tensor_parallel_nodes(g.gm, g.node_layer, g.layers)[1].items() if role == "sequence"}


def test_llama_norms_and_residual_adds_are_sequence_rotary_and_loss_are_not() -> None:
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    g = trace(transformers.LlamaForCausalLM(cfg), (), example_kwargs={"input_ids": ids, "labels": ids})
    roles = {n: g.nx.nodes[n]["tp_role"] for n in g.layers}
    norms = {f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    residuals = {n for n in g.layers if n.startswith("add_") and roles[n] != "sharded"}
    assert len(residuals) == 4  # two per block, after its attention and its MLP
    assert _sequence_layers(g) == norms | residuals | {"model.norm"}
    assert roles["model.rotary_emb"] == roles["cross_entropy_loss"] == "replicated"
    nodes = _sequence_nodes(g)
    # the lm head's input: model.norm's full-range slices are not token-wise, so they read the gathered value
    head_input = next(n for n in g.gm.graph.nodes if g.node_layer.get(n.name) == "lm_head"
                      and n.op == "call_function" and "linear" in str(n.target)).args[0]
    assert head_input.name not in nodes and "mul_4" in nodes  # input_layernorm's weight times the stream


def test_the_bundled_gpt_position_embedding_add_and_layer_norms() -> None:
    g = trace(TinyGPT(vocab=16, dim=8, heads=2, layers=2, max_len=4), (torch.randint(0, 16, (2, 4)),))
    blocks = {f"blocks.{b}.{n}" for b in range(2) for n in ("ln1", "ln2", "drop", "drop#1")}
    adds = {"add", "add_1", "add_2", "add_3", "add_4"}  # token + position embedding, then the residuals
    assert _sequence_layers(g) == blocks | adds | {"ln_f"}
    assert "getitem_1" not in _sequence_nodes(g)  # the position embedding's slice: full, sliced on entry


class _Mixer(nn.Module):
    """A vocabulary embedding and one MLP group, then ops over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> tuple[Tensor, ...]:
        x = self.tok(ids)
        y = x + self.down(torch.relu(self.up(x)))  # a residual add: sequence
        mixed = y.cumsum(1) * 2.0  # over the tokens, and all after it
        per_token = y.mean(-1)  # the features reduced without keepdim: the tokens move
        flat = y.reshape(y.shape[0], -1).relu()
        pooled = self.out(self.norm(y)[:, 0])  # the norm is sequence; the pooler is not
        return mixed, per_token, flat, pooled, y.mean(1, keepdim=True).exp()


def test_ops_that_mix_drop_or_reshape_tokens_are_not_sequence() -> None:
    g = trace(_Mixer(), (torch.randint(0, 16, (2, 4)),))
    roles = {n: g.nx.nodes[n]["tp_role"] for n in g.layers}
    assert roles["up"] == "column" and roles["down"] == "row"
    assert _sequence_layers(g) == {"add", "norm"}, roles
    assert {"cumsum", "mul", "mean", "relu_1", "out", "mean_1", "exp"} <= {n for n, r in roles.items()
                                                                           if r == "replicated"}, roles
