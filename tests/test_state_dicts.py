"""Pipeline checkpoints are exactly the model's state_dict, key for key (issue 11).

Loads go every way with ``strict=True``: pipeline -> plain model, plain model -> pipeline,
pipeline -> a new pipeline, and per-rank parts merged by ``merge_state_dicts`` -> plain model.
Every model is built from a tiny config with a different seed per copy, so a load that does not
happen (or lands in a copy the stages do not use) fails the value checks.
"""

from __future__ import annotations

import copy
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from autopipe.assemble.local import Pipeline, pipeline
from autopipe.assemble.ranks import distributed_pipeline, merge_state_dicts
from autopipe.assemble.setup import microbatch_inputs
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.frontend.tracing.graph import LayerGraph, trace
from autopipe.solvers.partitioner import partition
from tests.assemble.test_local import cost_profile
from tests.assemble.test_ranks import CHUNKS, _ok, _reference, spawn

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
             vocab_size=64)
DECODERS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def _hf(name: str, seed: int) -> nn.Module:
    """A tiny HF model, dropout off; ``seed`` picks its weights."""
    torch.manual_seed(seed)
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SIZES))
    config = getattr(transformers, f"{DECODERS[name]}Config")(num_key_value_heads=2, **SIZES)
    return getattr(transformers, f"{DECODERS[name]}ForCausalLM")(config)


IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def _pipeline(model: nn.Module, inputs: tuple[Tensor, ...], k: int, graph: LayerGraph | None = None) -> Pipeline:
    """``graph``: ``model``'s own trace, when one is reused (see ``hf_traced``)."""
    if graph is None:
        graph = trace(model, microbatch_inputs(inputs, 2))
    plan = partition(cost_profile(graph), stages=k, method="dp", chunks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipeline(model, inputs, devices=["cpu"] * k, chunks=2, plan=plan, graph=graph)


def _assert_same(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert_close(actual[key], value, msg=f"{key} differs")


def _differs(a: nn.Module, b: nn.Module) -> bool:
    sb = b.state_dict()
    return any(not torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def _output(out: Any) -> Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


HfTraced = Callable[[str, int, bool], tuple[nn.Module, LayerGraph]]


@pytest.fixture(scope="module")
def hf_traced() -> Iterator[HfTraced]:
    """``hf_traced(name, seed, eval)``: ``_hf(name, seed)`` (in eval mode if ``eval``) and its
    trace on IDS. torch.export is most of a test's time and a graph builds only with the model
    it was traced from, so each model is traced once per mode: every call gets a deep copy of
    that model and its graph together (the copy's graph holds the copy's tensors), with the
    seed's weights loaded into it, no gradients, nothing shared with another call's."""
    traced: dict[tuple[str, bool], tuple[nn.Module, LayerGraph]] = {}

    def get(name: str, seed: int, eval: bool) -> tuple[nn.Module, LayerGraph]:
        if (name, eval) not in traced:
            model = _hf(name, 0).train(not eval)
            traced[name, eval] = model, trace(model, microbatch_inputs((IDS,), 2))
        with warnings.catch_warnings():  # torch's pytree specs warn as they are copied
            warnings.simplefilter("ignore", FutureWarning)
            model, graph = copy.deepcopy(traced[name, eval])
        model.load_state_dict(_hf(name, seed).state_dict())
        return model.train(not eval), graph

    yield get
    traced.clear()


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "bert"])
def test_hf_checkpoints_load_strictly_every_way(name: str, k: int, hf_traced: HfTraced) -> None:
    model, graph = hf_traced(name, 0, True)
    pipe = _pipeline(model, (IDS,), k, graph).eval()
    nonpersistent = {n for n, _ in model.named_buffers()} - set(model.state_dict())
    assert nonpersistent  # inv_freq / position_ids: what the stages used to save
    state = pipe.state_dict()
    assert list(state) == [key for key in state if key in model.state_dict()]
    _assert_same(state, model.state_dict())

    plain = _hf(name, 1).eval()  # pipeline -> plain model
    assert _differs(plain, model)
    plain.load_state_dict(state, strict=True)
    _assert_same(plain.state_dict(), model.state_dict())

    other_model, graph = hf_traced(name, 2, True)  # plain model -> pipeline
    other = _pipeline(other_model, (IDS,), k, graph).eval()
    assert _differs(other_model, model)
    other.load_state_dict(plain.state_dict(), strict=True)
    _assert_same(other.state_dict(), model.state_dict())
    _assert_same(other_model.state_dict(), model.state_dict())  # the stages hold the model's

    new_model, graph = hf_traced(name, 3, False)  # pipeline -> a new pipeline
    third = _pipeline(new_model, (IDS,), k, graph).eval()
    third.load_state_dict(state, strict=True)
    _assert_same(third.state_dict(), model.state_dict())
    with torch.no_grad():
        assert_close(_output(third(IDS)), _output(model(IDS)))
        assert_close(_output(other(IDS)), _output(model(IDS)))


class Buffers(nn.Module):
    """Traced by torch.fx: a tied weight, BatchNorm's persistent buffers, a non-persistent
    buffer and a plain tensor attribute (each read by a ``get_attr`` node)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.out.weight = self.mid.weight
        self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)
        self.offset = torch.ones(16)

    def forward(self, x: Tensor) -> Tensor:
        h = self.bn(self.embed(x)) * self.scale + self.offset
        return self.out(torch.relu(self.mid(h)))


def test_fx_ties_batchnorm_and_constants_round_trip() -> None:
    x = torch.randn(8, 8)
    model = Buffers()
    pipe = _pipeline(model, (x,), 3)
    pipe(x).pow(2).mean().backward()  # training mode: BatchNorm's running statistics move
    assert int(model.get_buffer("bn.num_batches_tracked")) > 0
    state = pipe.state_dict()
    assert set(state) == set(model.state_dict())  # no "scale", no "offset"; both tie keys
    assert {"mid.weight", "out.weight", "bn.running_mean"} <= set(state)
    _assert_same(state, model.state_dict())
    torch.manual_seed(1)
    fresh = Buffers()
    fresh.load_state_dict(state, strict=True)
    _assert_same(fresh.state_dict(), model.state_dict())
    torch.manual_seed(2)
    other = _pipeline(Buffers(), (x,), 3)
    other.load_state_dict(model.state_dict(), strict=True)
    _assert_same(other.state_dict(), model.state_dict())
    assert other.stages[2].get_parameter("out.weight") is other.stages[1].get_parameter("mid.weight")
    assert_close(other.eval()(x), model.eval()(x))


def test_strict_load_into_the_pipeline_reports_the_models_own_names(hf_traced: HfTraced) -> None:
    model, graph = hf_traced("llama", 0, False)
    pipe = _pipeline(model, (IDS,), 3, graph)
    bad = _hf("llama", 1).state_dict()
    del bad["model.norm.weight"]
    bad["model.rotary_emb.inv_freq"] = model.get_buffer("model.rotary_emb.inv_freq")
    bad["lm_head.weight"] = torch.zeros(3, 3)
    messages = []
    for target in (pipe, _hf("llama", 2)):
        with pytest.raises(RuntimeError) as info:
            target.load_state_dict(bad, strict=True)
        messages.append(str(info.value).split("\n", 1))
    assert messages[0][0] == "Error(s) in loading state_dict for Pipeline:"
    assert messages[0][1] == messages[1][1]  # the same keys, in the model's names
    assert '"model.norm.weight"' in messages[0][1] and "size mismatch for lm_head.weight" in messages[0][1]
    bad["lm_head.weight"] = torch.zeros(64, 32)
    result = pipe.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["model.norm.weight"]
    assert result.unexpected_keys == ["model.rotary_emb.inv_freq"]
    assert_close(model.get_parameter("lm_head.weight"), torch.zeros(64, 32))


# --- merging per-rank parts ---------------------------------------------------------------
def refused(message: str, parts: list[Any], model: nn.Module | None = None) -> None:
    """merge_state_dicts(parts, model=model) fails with exactly this one-line message."""
    with pytest.raises(BuildError, match=f"^{re.escape(message)}$"):
        merge_state_dicts(parts, model=model)


def _lm_loss(out: Any, y: Tensor) -> Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))


def _batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)


def _save_llama_parts(rank: int, out: str, plans: dict[str, dict[str, Any]]) -> dict[str, str]:
    """A 2-stage Llama pipeline saved before and after one SGD step; a 4-stage one (2 per rank).
    One trace per rank: the second pipeline's model and graph are a copy of the first's, taken
    before that pipeline frees the model's other stages (the copy's graph holds the copy's tensors)."""
    ids, target = _batch()
    model = _hf("llama", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, microbatch_inputs((ids,), CHUNKS))
        second = copy.deepcopy((model, graph))  # torch's pytree specs warn as they are copied
    pipe = distributed_pipeline(model, (ids,), loss_fn=_lm_loss, plan=Plan.from_dict(plans["two"]),
                                chunks=CHUNKS, timeout=20, graph=graph)
    paths = {kind: os.path.join(out, f"{kind}{rank}.pt") for kind in ("start", "two", "four")}
    torch.save(pipe.state_dict(), paths["start"])
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=0.5)
    pipe.step(ids, target=target)
    opt.step()
    torch.save(pipe.state_dict(), paths["two"])
    other = distributed_pipeline(second[0], (ids,), loss_fn=_lm_loss, plan=Plan.from_dict(plans["four"]),
                                 chunks=CHUNKS, schedule="interleaved1f1b", timeout=20, graph=second[1])
    torch.save(other.state_dict(), paths["four"])
    # Nothing collective follows the second pipeline's group creation: without this barrier
    # rank 0 (which hosts the rendezvous store) could exit while rank 1 still uses the store.
    torch.distributed.barrier()
    return paths


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_parts_merge_into_the_plain_model_and_bad_merges_say_why(tmp_path: Path,
                                                                      hf_traced: HfTraced) -> None:
    # plans of equal layer counts, made here from made-up costs: the ranks neither profile nor
    # trace twice (IDS' micro-batch has _batch()'s shape, so the module's trace serves)
    _, graph = hf_traced("llama", 0, False)
    plans = {kind: partition(cost_profile(graph), stages=k, method="uniform", chunks=CHUNKS).to_dict()
             for kind, k in (("two", 2), ("four", 4))}
    ranks = _ok(spawn(_save_llama_parts, str(tmp_path), plans, timeout=100))
    start, two, four = ([r[kind] for r in ranks] for kind in ("start", "two", "four"))
    model = _hf("llama", 0)
    ids, target = _batch()
    _reference(model, (ids,), target, _lm_loss)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    parts = [torch.load(p, weights_only=True) for p in two]
    assert not set(parts[0]) & set(parts[1])
    assert set(parts[0]) | set(parts[1]) == set(model.state_dict())

    plain = _hf("llama", 1)
    plain.load_state_dict(merge_state_dicts(two, model=plain), strict=True)
    _assert_same(plain.state_dict(), model.state_dict())

    refused("got the parts of ranks [0] of a 2-rank pipeline: the part of rank(s) [1] is "
            "missing; pass one part per rank (2 in all)", [two[0]], plain)
    refused("checkpoint parts 0 and 1 come from different pipelines (part 0: rank 0 of 2, "
            "stages [0] of 2; part 1: rank 1 of 2, stages [1, 3] of 4); pass one part per rank "
            "of the same pipeline", [two[0], four[1]], plain)
    refused("checkpoint parts 0 and 1 are both rank 1's; pass one part per rank, ranks 0 to 1",
            [two[1], two[1]], plain)
    refused("checkpoint parts 0 and 1 were saved after different steps (1 and 0); save every "
            "rank's part after the same step", [two[0], start[1]], plain)
    # parts that do not say which rank they are (plain dicts): the keys tell
    n = len(model.state_dict())
    missing = sorted(set(model.state_dict()) - set(parts[0]), key=list(model.state_dict()).index)
    refused(f"merged checkpoint does not match the model: missing {missing[:3]} and "
            f"{len(missing) - 3} more ({len(missing)} of {n} keys), which no part holds: a rank's "
            "part is missing (pass one part per rank) or the parts come from a pipeline of "
            "another model", [dict(parts[0])], plain)


def test_bad_merges_name_the_keys_and_the_fix() -> None:
    model = _hf("llama", 0)
    state = model.state_dict()
    old = dict(state, **{"model.rotary_emb.inv_freq": model.get_buffer("model.rotary_emb.inv_freq")})
    with pytest.raises(BuildError, match=re.escape(
            "merged checkpoint does not match the model: ['model.rotary_emb.inv_freq'] are the "
            "model's non-persistent buffers (persistent=False: model.state_dict() leaves them "
            "out and the model rebuilds them), saved by an older autopipe; delete these keys "
            "from the parts, or re-save them with this version")):
        merge_state_dicts([old], model=model)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16))
    more = len(set(gpt2.state_dict()) - set(state)) - 3
    refused("merged checkpoint does not match the model: unexpected ['transformer.wte.weight', "
            f"'transformer.wpe.weight', 'transformer.h.0.ln_1.weight'] and {more} more, which "
            "the model does not have: the parts come from a pipeline of another model; pass the "
            "model it was built from",  # not "copies diverged" for its lm_head.weight
            [state, gpt2.state_dict()], model)
    with pytest.raises(BuildError, match=re.escape(
            "checkpoint parts 0 and 1 hold 'lm_head.weight' as torch.float32 (64, 32) and "
            "torch.float32 (3, 3): they come from pipelines of different models")):
        merge_state_dicts([state, {"lm_head.weight": torch.zeros(3, 3)}])
    with pytest.raises(BuildError, match=re.escape(
            "checkpoint part 1 disagrees with part 0 on 'lm_head.weight', a weight both ranks "
            "hold (tied or shared): its copies diverged")):
        merge_state_dicts([state, {"lm_head.weight": torch.zeros(64, 32)}])
    with pytest.raises(BuildError, match=r"^checkpoint part 0 \(.*nowhere\.pt\) could not be read "
                                         r"\(FileNotFoundError: .*\); pass the files saved with "):
        merge_state_dicts(["nowhere.pt"])
    with pytest.raises(BuildError, match="^no checkpoint parts given"):
        merge_state_dicts([])


def _part(rank: int, world: int, steps: int, **state: Tensor) -> Mapping[str, Tensor]:
    """A part as DistributedPipeline.state_dict() marks it ([Note: checkpoint parts])."""
    from collections import OrderedDict

    from executor.ranks.distributed import DistributedPipeline

    part: OrderedDict[str, Tensor] = OrderedDict(state)
    part._metadata = OrderedDict({DistributedPipeline.PART_METADATA: {  # type: ignore[attr-defined]
        "rank": rank, "world": world, "stages": [rank], "num_stages": world, "steps": steps}})
    return part


def test_complete_parts_with_missing_keys_are_another_models() -> None:
    model = nn.Linear(2, 2)
    parts = [_part(0, 2, 1, weight=torch.ones(2, 2)), _part(1, 2, 1)]
    with pytest.raises(BuildError, match=re.escape(
            "missing ['bias'] (1 of 2 keys), which no part holds: every rank's part is here, so "
            "they come from a pipeline of another model; pass the model it was built from")):
        merge_state_dicts(parts, model=model)
    parts[1] = _part(1, 2, 1, bias=torch.zeros(2))
    model.load_state_dict(merge_state_dicts(parts, model=model), strict=True)
    assert_close(model.weight, torch.ones(2, 2))
    assert_close(model.bias, torch.zeros(2))
