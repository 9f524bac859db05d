"""The tensor-parallel structure found in traced models ([Note: tensor-parallel structure]):
Megatron's roles per layer, written out by hand per family, against what the tracer found.

The four HF families trace through torch.export (2-3 s each): one decoder layer each, built
from a config on the CPU, nothing downloaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autopipe.examples import Block, get_example
from autopipe.frontend.tracing.graph import LayerGraph, trace
from tests.models import Chain, Skip

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
IDS = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}


def _roles(g: LayerGraph) -> dict[str, tuple[str, str, int]]:
    return {n: (g.nx.nodes[n]["tp_role"], g.nx.nodes[n]["tp_group"], g.nx.nodes[n]["tp_divides"])
            for n in g.layers}


def _hf(model: nn.Module) -> LayerGraph:
    return trace(model, (), example_kwargs=IDS)


def _check(roles: dict[str, tuple[str, str, int]], want: dict[str, tuple[str, str, int]]) -> None:
    assert {n: roles[n] for n in want} == want
    named = set(want)
    others = {n: r for n, r in roles.items() if n not in named}
    # every layer not named: replicated (position embeddings), sequence (norms, residual adds:
    # [Note: sequence nodes]), or an op inside a group's region, which is sharded in the group of
    # the row it feeds
    assert all(r[0] in ("replicated", "sequence", "sharded") for r in others.values()), others


def _llama_like(roles: dict[str, tuple[str, str, int]], heads_gcd: int, inter: int) -> None:
    attn, mlp = "attention:model.layers.0.self_attn.o_proj", "mlp:model.layers.0.mlp.down_proj"
    p = "model.layers.0."
    _check(roles, {
        "model.embed_tokens": ("vocab_embedding", "vocab", 64),
        "model.rotary_emb": ("replicated", "", 0),
        p + "input_layernorm": ("sequence", "", 0),
        p + "self_attn.q_proj": ("column", attn, heads_gcd),
        p + "self_attn.k_proj": ("column", attn, heads_gcd),
        p + "self_attn.v_proj": ("column", attn, heads_gcd),
        "scaled_dot_product_attention": ("sharded", attn, heads_gcd),
        p + "self_attn.o_proj": ("row", attn, heads_gcd),
        p + "post_attention_layernorm": ("sequence", "", 0),
        p + "mlp.gate_proj": ("column", mlp, inter),
        p + "mlp.act_fn": ("sharded", mlp, inter),
        p + "mlp.up_proj": ("column", mlp, inter),
        p + "mlp.down_proj": ("row", mlp, inter),
        "model.norm": ("sequence", "", 0),
        "lm_head": ("vocab_head", "vocab", 64),
    })


def test_llama_attention_splits_by_heads_and_kv_heads_and_swiglu_by_features() -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    _llama_like(_roles(_hf(transformers.LlamaForCausalLM(cfg))), heads_gcd=2, inter=48)


def test_qwen2_biased_projections_are_found_as_llama_s() -> None:
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32)
    _llama_like(_roles(_hf(transformers.Qwen2ForCausalLM(cfg))), heads_gcd=3, inter=96)


def test_gpt2_fused_qkv_conv1d_and_tied_head() -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=48, n_head=6, vocab_size=64, n_positions=32)
    roles = _roles(_hf(transformers.GPT2LMHeadModel(cfg)))
    p = "transformer.h.0."
    attn, mlp = f"attention:{p}attn.c_proj", f"mlp:{p}mlp.c_proj"
    _check(roles, {
        "transformer.wte": ("vocab_embedding", "vocab", 64),
        "transformer.wpe": ("replicated", "", 0),
        p + "ln_1": ("sequence", "", 0),
        p + "attn.c_attn": ("column", attn, 6),  # q, k and v in one weight: 6 heads, not 18
        "scaled_dot_product_attention": ("sharded", attn, 6),
        p + "attn.c_proj": ("row", attn, 6),
        p + "mlp.c_fc": ("column", mlp, 192),
        p + "mlp.act": ("sharded", mlp, 192),
        p + "mlp.c_proj": ("row", mlp, 192),
        "lm_head": ("vocab_head", "vocab", 64),  # tied to wte
    })


def test_bert_post_norm_blocks_and_the_mlm_head() -> None:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    roles = _roles(_hf(transformers.BertForMaskedLM(cfg)))
    p = "bert.encoder.layer.0."
    attn, mlp = f"attention:{p}attention.output.dense", f"mlp:{p}output.dense"
    _check(roles, {
        "bert.embeddings.word_embeddings": ("vocab_embedding", "vocab", 64),
        "bert.embeddings.position_embeddings": ("replicated", "", 0),
        "bert.embeddings.token_type_embeddings": ("replicated", "", 0),
        p + "attention.self.query": ("column", attn, 4),
        p + "attention.self.key": ("column", attn, 4),
        p + "attention.self.value": ("column", attn, 4),
        p + "attention.output.dense": ("row", attn, 4),
        p + "attention.output.LayerNorm": ("sequence", "", 0),
        p + "intermediate.dense": ("column", mlp, 64),
        p + "output.dense": ("row", mlp, 64),
        "cls.predictions.transform.dense": ("replicated", "", 0),  # a LayerNorm before the decoder
        "cls.predictions.decoder": ("vocab_head", "vocab", 64),
    })


def _example(name: str, **trace_kwargs: Any) -> LayerGraph:
    ex = get_example(name, 2)
    return trace(ex.model, ex.inputs, **trace_kwargs)


def test_the_bundled_gpt() -> None:
    roles = _roles(_example("gpt"))
    want: dict[str, tuple[str, str, int]] = {"tok": ("vocab_embedding", "vocab", 256), "add": ("sequence", "", 0),
                                             "ln_f": ("sequence", "", 0), "head": ("vocab_head", "vocab", 256)}
    for b in range(4):
        attn, mlp = f"attention:blocks.{b}.proj", f"mlp:blocks.{b}.fc2"
        want |= {f"blocks.{b}.ln1": ("sequence", "", 0), f"blocks.{b}.qkv": ("column", attn, 4),
                 f"blocks.{b}.proj": ("row", attn, 4), f"blocks.{b}.ln2": ("sequence", "", 0),
                 f"blocks.{b}.fc1": ("column", mlp, 256), f"blocks.{b}.act": ("sharded", mlp, 256),
                 f"blocks.{b}.fc2": ("row", mlp, 256)}
    _check(roles, want)


def test_a_cnn_has_no_structure() -> None:
    assert {r[0] for r in _roles(_example("cnn")).values()} == {"replicated"}
    assert {r[0] for r in _roles(_example("unet")).values()} == {"replicated"}


def test_a_linear_relu_chain_pairs_first_with_second() -> None:
    roles = _roles(trace(Chain((8, 16, 16, 16, 4)), torch.randn(4, 8)))
    assert roles == {"net.0": ("column", "mlp:net.2", 16), "net.1": ("sharded", "mlp:net.2", 16),
                     "net.2": ("row", "mlp:net.2", 16), "net.3": ("replicated", "", 0),
                     "net.4": ("column", "mlp:net.6", 16), "net.5": ("sharded", "mlp:net.6", 16),
                     "net.6": ("row", "mlp:net.6", 16)}


def test_a_split_value_never_meets_a_full_one() -> None:
    # d reads c's output plus a's: a is read by b too, so neither (a, d) nor (c, d) is a group
    roles = _roles(trace(Skip(), torch.randn(4, 8)))
    assert roles["b"][0] == "column" and roles["c"][0] == "row"
    assert roles["a"][0] == roles["d"][0] == roles["add"][0] == "replicated"


def test_coarse_layers_are_planned_replicated() -> None:
    roles = _roles(_example("gpt", leaf_modules=[Block]))
    assert {n: r[0] for n, r in roles.items() if n.startswith("blocks")} == {
        f"blocks.{b}": "replicated" for b in range(4)}
    assert roles["head"][0] == "vocab_head"  # the vocabulary still splits


def test_a_repeated_trace_finds_what_the_whole_one_does() -> None:
    # trace(repeated=True) grows the graph of 4 blocks from 2 and 3 ([Note: repeated blocks])
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    whole, grown = _hf(model), trace(model, (), example_kwargs=IDS, repeated=True)
    assert grown.layers == whole.layers and _roles(grown) == _roles(whole)
    assert sum(r[0] == "row" for r in _roles(grown).values()) == 8
