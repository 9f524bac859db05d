"""autopipe.frontend.building.weights: every weights format, tied keys stored once, and every bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from autopipe.frontend.building.weights import (
    TensorInfo,
    WeightsError,
    match_weights,
    open_weights,
)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"emb.weight": torch.randn(10, 4), "lin.weight": torch.randn(3, 4),
            "lin.bias": torch.randn(3), "steps": torch.arange(5)}


def _expected(state: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {k: TensorInfo(tuple(v.shape), v.dtype) for k, v in state.items()}


def _sharded(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map = {}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / name))
        weight_map.update(dict.fromkeys(names, name))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "folder", "torch", "mapping"])
def test_every_format_reads_the_same_tensors(tmp_path: Path, kind: str) -> None:
    state = _state()
    if kind == "safetensors":
        save_file(state, str(tmp_path / "m.safetensors"))
        weights: object = tmp_path / "m.safetensors"
    elif kind in ("sharded", "folder"):
        index = _sharded(tmp_path, state)
        weights = index if kind == "sharded" else tmp_path
    elif kind == "torch":
        torch.save({"state_dict": state, "optimizer": {}}, tmp_path / "m.pt")
        weights = tmp_path / "m.pt"
    else:
        weights = state
    source = open_weights(weights)  # type: ignore[arg-type]
    assert sorted(source.keys()) == sorted(state)
    assert source.info("lin.weight") == TensorInfo((3, 4), torch.float32)
    assert source.info("steps").dtype == torch.int64
    got = source.read(["lin.bias", "steps"])
    assert sorted(got) == ["lin.bias", "steps"]  # only what was asked for
    for key, value in got.items():
        torch.testing.assert_close(value, state[key])


def test_a_tied_key_stored_once_reads_its_alias() -> None:
    state = _state()
    expected = {**_expected(state), "head.weight": TensorInfo((10, 4), torch.float32)}
    aliases = {"head.weight": ["emb.weight"], "emb.weight": ["head.weight"]}
    found = match_weights(open_weights(state), expected, aliases)
    assert found["head.weight"] == "emb.weight" and found["emb.weight"] == "emb.weight"


@pytest.mark.parametrize(("change", "match"), [
    ("missing", r"lacks 1 of the model's keys, e.g. \['lin.bias'\]; save the complete state_dict"),
    ("extra", r"has 1 key\(s\) the model does not, e.g. \['other.weight'\]; these are weights of another model"),
    ("other", r"does not fit this model: 1 of its 4 keys are missing .* and 1 keys are not the model's"),
    ("shape", r"'lin.weight' is \[3, 5\] in the file but \[3, 4\] in the model; the weights are for another configuration"),
])
def test_weights_for_another_model_are_named(change: str, match: str) -> None:
    state = _state()
    expected = _expected(state)
    if change == "missing":
        del state["lin.bias"]
    elif change == "extra":
        state["other.weight"] = torch.zeros(1)
    elif change == "other":
        state["other.bias"] = state.pop("lin.bias")
    else:
        state["lin.weight"] = torch.zeros(3, 5)
    with pytest.raises(WeightsError, match=match) as err:
        match_weights(open_weights(state), expected)
    assert "\n" not in str(err.value)


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00\x01not a safetensors file")
    bad_json = tmp_path / "bad.safetensors.index.json"
    bad_json.write_text("{not json")
    no_map = tmp_path / "nomap.safetensors.index.json"
    no_map.write_text(json.dumps({"metadata": {}}))
    lost = tmp_path / "lost.safetensors.index.json"
    lost.write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    pickle = tmp_path / "model.pt"
    torch.save([1, 2, 3], pickle)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"garbage")
    cases = [
        (corrupt, "is not a readable safetensors file"),
        (bad_json, "is not a safetensors index"),
        (no_map, "is not a safetensors index"),
        (lost, "names shard(s) that do not exist next to it: ['gone.safetensors']"),
        (pickle, "holds a list, not a state_dict"),
        (garbage, "cannot be loaded with torch.load(weights_only=True)"),
        (tmp_path / "missing.safetensors", "does not exist"),
        (tmp_path / "weights.npz", "does not exist"),
        (tmp_path, "holds neither model.safetensors nor model.safetensors.index.json"),
    ]
    (tmp_path / "weights.npz").unlink(missing_ok=True)
    for path, match in cases:
        with pytest.raises(WeightsError) as err:
            open_weights(path)
        assert match in str(err.value) and "\n" not in str(err.value), (path, str(err.value))
    npz = tmp_path / "w.npz"
    npz.write_bytes(b"")
    with pytest.raises(WeightsError, match="unknown weights format '.npz'"):
        open_weights(npz)
    with pytest.raises(WeightsError, match="holds non-tensor entries"):
        open_weights({"a": nn.Linear(1, 1)})  # type: ignore[dict-item]


def test_an_index_whose_shards_lack_a_key_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, str(tmp_path / "s.safetensors"))
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s.safetensors", "b": "s.safetensors"}}))
    with pytest.raises(WeightsError, match=r"lists 1 key\(s\) its shards do not hold, e.g. \['b'\]"):
        open_weights(index)


def test_sharded_save_round_trips_and_stores_a_tie_once(tmp_path: Path) -> None:
    from autopipe.frontend.building.weights import save_sharded

    emb = torch.randn(10, 4)
    parts = [{"emb.weight": emb, "lin.weight": torch.randn(3, 4)},
             {"head.weight": emb, "lin2.bias": torch.randn(3)}]  # head tied to emb, across parts
    index = save_sharded(parts, tmp_path / "out")
    data = json.loads(index.read_text())
    assert data["weight_map"] == {"emb.weight": "model-00001-of-00002.safetensors",
                                  "lin.weight": "model-00001-of-00002.safetensors",
                                  "lin2.bias": "model-00002-of-00002.safetensors"}
    source = open_weights(tmp_path / "out")  # the folder works as well as the index
    expected = {k: TensorInfo(tuple(v.shape), v.dtype) for p in parts for k, v in p.items()}
    found = match_weights(source, expected, {"head.weight": ["emb.weight"]})
    assert found["head.weight"] == "emb.weight"
    torch.testing.assert_close(source.read(["emb.weight"])["emb.weight"], emb)
    with pytest.raises(WeightsError, match="already exists: refusing to overwrite saved weights"):
        save_sharded(parts, tmp_path / "out")
    assert save_sharded(parts, tmp_path / "out", overwrite=True) == index
