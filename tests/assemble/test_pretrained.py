"""pipe.save_pretrained(folder) ([Note: saved as the model] in autopipe/assemble/pretrained.py):
a trained pipeline's folder is read by HuggingFace's from_pretrained and by weights=, and gives
the pipeline's own outputs; one shard per stage; nothing saved is overwritten unless asked."""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn
from torch.testing import assert_close

import autopipe
from autopipe.frontend.building.weights import WeightsError
from tests.assemble.test_local import cost_profile, made_up_pipeline
from tests.models import tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers")


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (4, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


@functools.cache
def _trained(make: Callable[[], nn.Module]) -> tuple[autopipe.Pipeline, dict[str, torch.Tensor]]:
    """A pipeline of two stages after one SGD step, so that its weights are not the model's
    initial ones: one per model for the module's tests, which only read it. Its plan splits
    made-up costs (test_local's cost_profile): what is saved does not depend on the cut."""
    torch.manual_seed(0)
    batch = _batch()
    pipe = made_up_pipeline(make(), example_kwargs=batch)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe(**batch).loss.backward()
    opt.step()
    return pipe.eval(), batch


@pytest.mark.compat  # HF's from_pretrained of each supported transformers reads the folder
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_from_pretrained_and_weights_give_the_trained_pipelines_outputs(make: Callable[[], nn.Module],
                                                                        tmp_path: Path) -> None:
    pipe, batch = _trained(make)
    index = pipe.save_pretrained(tmp_path / "saved")
    assert index == tmp_path / "saved" / "model.safetensors.index.json"
    with torch.no_grad():
        expected = pipe(**batch)

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert type(loaded) is type(make())
    with torch.no_grad():
        got = loaded(**batch)
    assert_close(got.logits, expected.logits)
    assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)  # the whole batch vs 2 micro-batches
    trained = pipe.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key

    torch.manual_seed(1)  # other initial weights: every tensor must come from the folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = autopipe.pipeline(make(), example_kwargs=batch, devices=["cpu", "cpu"], chunks=2,
                                  plan=pipe.plan, weights=tmp_path / "saved").eval()
    with torch.no_grad():
        assert_close(again(**batch).logits, expected.logits)


def test_one_shard_per_stage_in_the_models_keys_with_a_tie_stored_once(tmp_path: Path) -> None:
    pipe, _ = _trained(tiny_gpt2)  # lm_head.weight is transformer.wte.weight
    pipe.save_pretrained(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for s, (stage, name) in enumerate(zip(pipe.stages, files, strict=True)):
        with safe_open(tmp_path / name, "pt") as f:
            keys = set(f.keys())
        assert keys == {k for k, v in weight_map.items() if v == name}, s
        assert keys <= set(stage.state_dict()), s  # only the stage's own tensors
    state = pipe.state_dict()
    assert set(weight_map) | {"lm_head.weight"} == set(state)  # the tie's alias is left to the config
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"


def test_a_saved_model_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    llama, _ = _trained(tiny_llama)
    llama.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    gpt2, _ = _trained(tiny_gpt2)
    with pytest.raises(WeightsError, match=r"^.*config\.json already exists: refusing to overwrite a saved "
                                           r"model; pass overwrite=True or choose another folder$"):
        gpt2.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    gpt2.save_pretrained(tmp_path, overwrite=True)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after.keys() == before.keys() and all(after[name] != before[name] for name in after)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"


def test_a_plain_module_saves_its_weights_and_index_for_weights(tmp_path: Path) -> None:
    ex = autopipe.get_example("mlp", batch_size=8)
    pipe = made_up_pipeline(ex.model, ex.inputs)
    pipe.save_pretrained(tmp_path / "mlp")
    assert sorted(p.name for p in (tmp_path / "mlp").iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = autopipe.pipeline(autopipe.get_example("mlp", batch_size=8).model, ex.inputs,
                                  devices=["cpu", "cpu"], chunks=2, plan=pipe.plan, weights=tmp_path / "mlp")
    for (key, want), got in zip(pipe.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(want, got), key


def test_a_file_in_place_of_the_folder_is_one_line(tmp_path: Path) -> None:
    pipe, _ = _trained(tiny_llama)
    (tmp_path / "taken").write_text("mine")
    with pytest.raises(WeightsError, match=r"taken is a file, not a folder: pass a folder to save_pretrained$"):
        pipe.save_pretrained(tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "mine"


def _stepped_on_ranks(batch: dict[str, torch.Tensor], plan: dict[str, Any]) -> Any:
    """The seeded tied GPT-2 as this rank's part of ``plan``, after one SGD step on ``batch``."""
    from autopipe.assemble.ranks import distributed_pipeline
    from autopipe.core.plan import Plan

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = distributed_pipeline(tiny_gpt2(), example_kwargs=batch, chunks=2, plan=Plan.from_dict(plan),
                                    timeout=30)
    opt = torch.optim.SGD(pipe.stage_module.parameters(), lr=0.5)
    pipe.step(**batch)
    opt.step()
    return pipe


def _saved_on_ranks(rank: int, plan: dict[str, Any], folder: str) -> dict[str, Any]:
    """One SGD step of the tied GPT-2 on 2 ranks, then save_pretrained on both, twice: the second
    refused (a collective: both ranks raise the same line)."""
    batch = _batch()
    pipe = _stepped_on_ranks(batch, plan)
    index = pipe.save_pretrained(folder)
    try:
        pipe.save_pretrained(folder)
        refused = None
    except WeightsError as err:
        refused = str(err)
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    return {"index": str(index), "refused": refused, "state": state, "logits": pipe.eval().eval_step(**batch)}


def test_two_ranks_each_save_their_stage_and_from_pretrained_reads_the_trained_model(tmp_path: Path) -> None:
    from tests.assemble.test_ranks import _ok, spawn

    torch.manual_seed(0)
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = autopipe.trace(tiny_gpt2(), (), example_kwargs={k: v[:2] for k, v in batch.items()})
    plan = autopipe.partition(cost_profile(graph), stages=2, chunks=2)
    first, last = _ok(spawn(_saved_on_ranks, plan.to_dict(), str(tmp_path)))
    assert first["index"] == last["index"] == str(tmp_path / "model.safetensors.index.json")
    line = (f"{tmp_path}/config.json already exists: refusing to overwrite a saved model; pass overwrite=True "
            "or choose another folder")
    assert first["refused"] == last["refused"] == line
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "transformer.wte.weight" in weight_map  # stored once
    for rank, (values, name) in enumerate(zip((first, last), sorted(set(weight_map.values())), strict=True)):
        with safe_open(tmp_path / name, "pt") as f:  # one shard per stage, each its rank's own tensors
            assert set(f.keys()) == {k for k, v in weight_map.items() if v == name}
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), values["state"][key]), (rank, key)
    trained = {**first["state"], **last["state"]}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert set(loaded.state_dict()) == set(trained)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    with torch.no_grad():
        assert_close(loaded(**batch).logits, last["logits"].logits)


def _saved_by_replicas(rank: int, plans: dict[str, dict[str, Any]], folder: str) -> dict[str, Any]:
    """Two replicas of one stage of the tied GPT-2, one SGD step each on its own rows, saved."""
    out = {}
    for mode, plan in plans.items():
        pipe = _stepped_on_ranks({k: v.tensor_split(2)[rank] for k, v in _batch().items()}, plan)
        pipe.save_pretrained(f"{folder}/{mode}")
        out[mode] = {k: v.clone() for k, v in pipe.state_dict().items()}  # whole, equal on both replicas
    return out


def test_replicas_save_the_first_replicas_stages_under_ddp_and_fsdp(tmp_path: Path) -> None:
    from tests.assemble.test_ranks import _ok, spawn

    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = autopipe.trace(tiny_gpt2(), (), example_kwargs={k: v[:1] for k, v in batch.items()})
    plans = {mode: autopipe.partition(cost_profile(graph), stages=1, chunks=2, data_parallel=2,
                                      dp_mode=mode).to_dict() for mode in ("ddp", "fsdp")}
    # ranks of their own: after other tests on the shared pool, FSDP's full_tensor of a stage once
    # failed a torch shape check (see the session note); alone it never has
    first, second = _ok(spawn(_saved_by_replicas, plans, str(tmp_path), fresh=True))
    for mode in plans:
        for key, value in first[mode].items():
            assert torch.equal(value, second[mode][key]), (mode, key)  # the replicas agree
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / mode)
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, first[mode][key]), (mode, key)
        assert sorted(p.name for p in (tmp_path / mode).iterdir()) == [
            "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
            "model.safetensors.index.json"]
