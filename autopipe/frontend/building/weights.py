"""Named tensors from a weights file, read a few at a time: what each stage needs, never all.

    source = open_weights("llama/model.safetensors.index.json")   # or .safetensors, .pt, a dict
    match = match_weights(source, expected, aliases)               # model key -> source key
    tensors = source.read(["model.layers.0.mlp.up_proj.weight"], device="cuda:1")

[Note: weights by key] A weights file is addressed by the plain model's state_dict keys. Sources:

- a ``.safetensors`` file, or a HuggingFace sharded checkpoint (``*.safetensors.index.json``
  and its shards, or a folder holding either): tensors are read one key at a time through
  ``safetensors.safe_open``, so a stage reads only its own tensors from the shards that hold
  them, and nothing else of the file ever becomes process memory;
- a ``torch.save``d state_dict (``.pt``, ``.pth``, ``.bin``), loaded with ``mmap=True``: its
  pages are the file's until a tensor is copied out;
- a mapping of key -> tensor.

Tied parameters are stored once (HuggingFace saves a tied head under one name only): a model key
missing from the source is satisfied by any other key naming the same tensor in the model.
Anything else missing, any key the model does not have, and any shape mismatch is one
:class:`WeightsError` naming the keys: nothing is silently left uninitialised.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch
from torch import Tensor

from autopipe.core.atomic_files import atomic_write, atomic_write_text
from autopipe.errors import BuildError, first_line

__all__ = ["Weights", "WeightsError", "TensorInfo", "WeightSource", "open_weights", "match_weights", "save_sharded",
           "shard_names", "storage_key", "write_index", "write_shard"]

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


class WeightsError(BuildError):
    """A weights file cannot be read, or does not fit the model."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class WeightSource:
    """Named tensors that can be listed and described without reading them, and read by key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def keys(self) -> list[str]:
        raise NotImplementedError

    def info(self, key: str) -> TensorInfo:
        raise NotImplementedError

    def read(self, keys: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        raise NotImplementedError


# What ``weights=`` accepts ([Note: weights by key]).
Weights: TypeAlias = "str | os.PathLike[str] | Mapping[str, Tensor] | WeightSource"


class _MappingSource(WeightSource):
    def __init__(self, tensors: Mapping[str, Any], where: str) -> None:
        super().__init__(where)
        bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, Tensor)]
        if bad:
            raise WeightsError(f"{where} holds non-tensor entries, e.g. {bad[:3]}; pass a state_dict "
                               "(key -> tensor), e.g. model.state_dict()")
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def info(self, key: str) -> TensorInfo:
        t = self._tensors[key]
        return TensorInfo(tuple(t.shape), t.dtype)

    def read(self, keys: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        return {k: self._tensors[k].to(device) for k in keys}


class _SafetensorsSource(WeightSource):
    """One or more safetensors files; ``files[key]`` is the file holding ``key``."""

    def __init__(self, files: Mapping[str, Path], where: str) -> None:
        super().__init__(where)
        from safetensors import safe_open

        self._files = dict(files)
        self._info: dict[str, TensorInfo] = {}
        for path in sorted(set(self._files.values())):
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for key in f.keys():
                        if self._files.get(key) != path:
                            continue
                        piece = f.get_slice(key)
                        self._info[key] = TensorInfo(tuple(piece.get_shape()),
                                                     _dtype(piece.get_dtype(), key, path))
            except WeightsError:
                raise
            except Exception as err:  # safetensors raises its own SafetensorError, OSError, ...
                raise WeightsError(f"{path} is not a readable safetensors file ({first_line(err)}); "
                                   "re-save it with safetensors.torch.save_file") from None
        absent = sorted(set(self._files) - set(self._info))
        if absent:
            raise WeightsError(f"{where} lists {len(absent)} key(s) its shards do not hold, e.g. "
                               f"{absent[:3]}; the index and the shards are from different saves")

    def keys(self) -> list[str]:
        return list(self._info)

    def info(self, key: str) -> TensorInfo:
        return self._info[key]

    def read(self, keys: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self._files[key], []).append(key)
        out: dict[str, Tensor] = {}
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in names:
                    out[key] = f.get_tensor(key)
        return out


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _dtype(name: str, key: str, path: Path) -> torch.dtype:
    if name not in _SAFETENSORS_DTYPES:
        raise WeightsError(f"{path}: tensor {key!r} has dtype {name}, which autopipe cannot load; "
                           f"convert it to one of {sorted(_SAFETENSORS_DTYPES)}")
    return _SAFETENSORS_DTYPES[name]


def _safetensors_files(path: Path) -> dict[str, Path]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), path)
    except Exception as err:
        raise WeightsError(f"{path} is not a readable safetensors file ({first_line(err)}); "
                           "re-save it with safetensors.torch.save_file") from None


def _index_files(index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise WeightsError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'; "
                           f"{first_line(err)}); point weights= at the index HuggingFace's "
                           "save_pretrained wrote, or at a .safetensors file") from None
    files = {str(k): index.parent / str(v) for k, v in weight_map.items()}
    missing = sorted({p.name for p in files.values() if not p.exists()})
    if missing:
        raise WeightsError(f"{index} names shard(s) that do not exist next to it: {missing[:3]}; "
                           "copy every shard into that folder")
    return files


def _torch_file(path: Path) -> Mapping[str, Any]:
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise WeightsError(f"{path} cannot be loaded with torch.load(weights_only=True) "
                           f"({first_line(err)}); save a plain state_dict with torch.save") from None
    if isinstance(data, Mapping) and "state_dict" in data and isinstance(data["state_dict"], Mapping):
        data = data["state_dict"]  # the common {"state_dict": ..., "optimizer": ...} layout
    if not isinstance(data, Mapping):
        raise WeightsError(f"{path} holds a {type(data).__name__}, not a state_dict; save "
                           "model.state_dict() with torch.save")
    return data


def open_weights(weights: Weights) -> WeightSource:
    """A :class:`WeightSource` for a file, a folder, a sharded index or a mapping
    ([Note: weights by key])."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping):
        return _MappingSource(weights, "the weights mapping")
    path = Path(weights)
    if path.is_dir():
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (path / name).exists():
                return open_weights(path / name)
        raise WeightsError(f"{path} holds neither model.safetensors nor "
                           "model.safetensors.index.json; point weights= at the weights file")
    if not path.exists():
        raise WeightsError(f"weights file {path} does not exist; check the path")
    if path.name.endswith(".json"):
        return _SafetensorsSource(_index_files(path), str(path))
    if path.suffix == ".safetensors":
        return _SafetensorsSource(_safetensors_files(path), str(path))
    if path.suffix in _TORCH_SUFFIXES:
        return _MappingSource(_torch_file(path), str(path))
    raise WeightsError(f"{path}: unknown weights format {path.suffix!r}; use a .safetensors file, "
                       f"a *.safetensors.index.json, or a torch.save'd state_dict ({', '.join(_TORCH_SUFFIXES)})")


def match_weights(
    source: WeightSource,
    expected: Mapping[str, TensorInfo],
    aliases: Mapping[str, Iterable[str]] | None = None,
) -> dict[str, str]:
    """Model key -> the source key holding its value, after checking the whole key set.

    ``expected``: the plain model's state_dict keys with their shapes and dtypes. ``aliases``:
    each key -> the other keys naming the same tensor (tied weights); a tied key missing from
    the source reads any alias present. Raises WeightsError for missing keys, keys the model
    does not have, or shape mismatches (dtype differences are cast on load).
    """
    have = set(source.keys())
    aliases = aliases or {}
    found: dict[str, str] = {}
    missing: list[str] = []
    for key in expected:
        if key in have:
            found[key] = key
            continue
        alias = next((a for a in aliases.get(key, ()) if a in have), None)
        if alias is None:
            missing.append(key)
        else:
            found[key] = alias
    unexpected = sorted(have - set(expected))
    if missing and unexpected:
        raise WeightsError(
            f"{source.where} does not fit this model: {len(missing)} of its {len(expected)} keys "
            f"are missing (e.g. {missing[:3]}) and {len(unexpected)} keys are not the model's "
            f"(e.g. {unexpected[:3]}); these are weights of another model or another version")
    if missing:
        raise WeightsError(f"{source.where} lacks {len(missing)} of the model's keys, e.g. "
                           f"{missing[:3]}; save the complete state_dict of this model")
    if unexpected:
        raise WeightsError(f"{source.where} has {len(unexpected)} key(s) the model does not, e.g. "
                           f"{unexpected[:3]}; these are weights of another model or another version")
    wrong = [(k, source.info(s).shape, expected[k].shape) for k, s in found.items()
             if source.info(s).shape != expected[k].shape]
    if wrong:
        key, got, want = wrong[0]
        raise WeightsError(f"{source.where}: {len(wrong)} tensor(s) have the wrong shape, e.g. "
                           f"{key!r} is {list(got)} in the file but {list(want)} in the model; "
                           "the weights are for another configuration of this model")
    return found


def _save_shard(save_file: Any, shard: dict[str, Tensor], tmp: str) -> None:
    save_file(shard, tmp, metadata={"format": "pt"})


def shard_names(k: int) -> list[str]:
    """The file of each of ``k`` shards, as HuggingFace's sharded checkpoints name them."""
    return [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]


def storage_key(t: Tensor) -> tuple[int, int]:
    """Where ``t``'s values live (storage, offset): one key for a tensor and its tied aliases."""
    return t.untyped_storage().data_ptr(), int(t.storage_offset())


def write_shard(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """One safetensors shard of ``tensors`` (copied to the host), written whole or not at all."""
    from safetensors.torch import save_file

    shard = {key: value.detach().to("cpu").contiguous() for key, value in tensors.items()}
    atomic_write(path, functools.partial(_save_shard, save_file, shard))


def write_index(folder: Path, weight_map: Mapping[str, str], total: int) -> Path:
    """The index HuggingFace reads (``model.safetensors.index.json``): each key's shard file."""
    index = folder / "model.safetensors.index.json"
    atomic_write_text(index, json.dumps({"metadata": {"total_size": total}, "weight_map": dict(weight_map)},
                                        indent=2) + "\n")
    return index


def save_sharded(
    parts: Iterable[Mapping[str, Tensor]], folder: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Write one safetensors shard per part (per stage) and the index HuggingFace reads.

    ``parts``: each stage's ``state_dict`` in the model's keys, in stage order. A tensor held by
    several parts (a tie across stages) is stored once, in the first part that holds it; a key
    naming an already stored tensor (a tie within a part) is left to its alias, as
    ``save_pretrained`` does. Returns the index path (``model.safetensors.index.json``), which
    ``weights=`` accepts. Existing files are kept unless ``overwrite``.
    """
    root = Path(folder)
    states = [dict(p) for p in parts]
    index = root / "model.safetensors.index.json"
    names = shard_names(len(states))
    taken = [str(p) for p in (index, *(root / n for n in names)) if p.exists()]
    if taken and not overwrite:
        raise WeightsError(f"{taken[0]} already exists: refusing to overwrite saved weights; "
                           "pass overwrite=True or choose another folder")
    stored: dict[tuple[int, int], str] = {}  # (storage pointer, offset) -> key written
    weight_map: dict[str, str] = {}
    total = 0
    for name, state in zip(names, states, strict=True):
        shard: dict[str, Tensor] = {}
        for key, value in state.items():
            where = storage_key(value)
            if where in stored:  # a tie: its alias holds it
                continue
            stored[where] = key
            shard[key] = value
            weight_map[key] = name
            total += value.numel() * value.element_size()
        write_shard(root / name, shard)
    return write_index(root, weight_map, total)
