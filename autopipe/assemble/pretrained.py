"""``pipe.save_pretrained(folder)``: a folder that HuggingFace's ``from_pretrained`` and
autopipe's ``weights=`` both read, written one shard per stage.

    pipe = autopipe.pipeline(model, example_kwargs=batch, devices=["cuda:0", "cuda:1"])
    ...  # train
    pipe.save_pretrained("out/llama-tuned")
    AutoModelForCausalLM.from_pretrained("out/llama-tuned")          # the trained model, whole
    autopipe.pipeline(meta_model, ..., weights="out/llama-tuned")    # or as a pipeline again

[Note: saved as the model] The folder is what ``model.save_pretrained`` writes for a sharded
model: the model's ``config.json`` (and ``generation_config.json`` where the model has one), one
safetensors shard per stage in the original model's keys, and ``model.safetensors.index.json``
(autopipe.frontend.building.weights.save_sharded). A tensor two stages hold (a tie across
stages) is stored once, under the name HuggingFace stores it by (its tie's source, such as
``transformer.wte.weight``; the tied ``lm_head.weight`` is left to the config's
``tie_word_embeddings``, as ``model.save_pretrained`` leaves it), else under the first stage's key. Each stage's tensors are copied to the host one stage at a time: the
model is never gathered whole. On ranks (``DistributedPipeline.save_pretrained``, called on every
rank) each rank writes its own stages' shards: the ranks agree on the keys first (names and sizes
only cross the wire), a key two ranks hold (a tie, whose alias each holds) is stored by the
first stage's rank, and rank 0 writes the index and the configs once every shard is whole. With
replicas, the first replica's ranks write (under FSDP each stage's tensors are gathered whole on
its ranks first, as its ``state_dict`` does).
Nothing that a folder already holds is overwritten unless
``overwrite=True``; a model without a HuggingFace config (a plain ``nn.Module``) gets the weights
and the index only, which ``weights=`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from autopipe.frontend.building.weights import (
    WeightsError,
    save_sharded,
    shard_names,
    storage_key,
    write_index,
    write_shard,
)

__all__ = ["save_pretrained", "save_on_ranks", "model_configs"]

_CONFIG_FILES = ("config.json", "generation_config.json")


def model_configs(model: Any) -> tuple[Any, Any, frozenset[str]]:
    """A HuggingFace model's ``config``, ``generation_config`` (None for a plain module) and
    the keys its ties make aliases (``lm_head.weight`` of a tied LM), kept by a pipeline at build
    time: the model itself is not kept."""
    config = getattr(model, "config", None)
    generation = getattr(model, "generation_config", None)
    ties = getattr(model, "all_tied_weights_keys", None)  # target -> source, the ties in force
    return (config if hasattr(config, "save_pretrained") else None,
            generation if hasattr(generation, "save_pretrained") else None,
            frozenset(ties) if isinstance(ties, Mapping) else frozenset())


def save_pretrained(parts: Sequence[Mapping[str, Tensor]], configs: tuple[Any, Any, frozenset[str]],
                    folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``parts`` (each stage's tensors in the model's keys, in stage order) and the model's
    ``configs`` into ``folder`` ([Note: saved as the model]). Returns the index's path."""
    root = Path(folder)
    refusal = _refusal(root, configs, shard_names(len(parts)), overwrite)  # before anything is written
    if refusal is not None:
        raise WeightsError(refusal)
    config, generation, aliases = configs
    root.mkdir(parents=True, exist_ok=True)
    parts = _without_aliases(parts, aliases)
    index = save_sharded(parts, root, overwrite=overwrite)
    _write_configs(root, config, generation)
    return index


def _refusal(root: Path, configs: tuple[Any, Any, frozenset[str]], shards: Sequence[str],
             overwrite: bool) -> str | None:
    """Why ``root`` cannot take a saved model (a file in its place, or a saved model there and no
    ``overwrite``), or None."""
    if root.exists() and not root.is_dir():
        return f"{root} is a file, not a folder: pass a folder to save_pretrained"
    if overwrite:
        return None
    names = [n for n, c in zip(_CONFIG_FILES, configs[:2], strict=True) if c is not None]
    taken = [str(root / n) for n in (*names, *shards, "model.safetensors.index.json") if (root / n).exists()]
    if taken:
        return (f"{taken[0]} already exists: refusing to overwrite a saved model; pass overwrite=True or "
                "choose another folder")
    return None


def _without_aliases(parts: Sequence[Mapping[str, Tensor]], aliases: frozenset[str]) -> list[dict[str, Tensor]]:
    """``parts`` less each tie's alias whose tensor a part holds under its source's name."""
    sources = {storage_key(v) for part in parts for k, v in part.items() if k not in aliases}
    return [{k: v for k, v in part.items() if k not in aliases or storage_key(v) not in sources} for part in parts]


def _write_configs(root: Path, config: Any, generation: Any) -> None:
    if config is not None:
        config.save_pretrained(root)
    if generation is not None:
        generation.save_pretrained(root)


def save_on_ranks(pipe: Any, configs: tuple[Any, Any, frozenset[str]], folder: str | os.PathLike[str], *,
                  overwrite: bool = False) -> Path:
    """[Note: saved as the model] on the ranks of ``pipe`` (a DistributedPipeline); a collective:
    every rank calls it. Returns the index's path."""
    import torch.distributed as dist

    root = Path(folder)
    names = shard_names(pipe.num_stages)
    verdict: list[Any] = [_refusal(root, configs, names, overwrite) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)  # every rank refuses, or none
    if verdict[0] is not None:
        raise WeightsError(verdict[0])
    config, generation, aliases = configs
    state = pipe.state_dict()  # this rank's tensors, whole (under FSDP a collective of the dp group)
    parts = {i: {alias: state[alias] for key in stage.state_dict(keep_vars=True)
                 for alias in pipe.key_aliases.get(key, [key])}
             for i, stage in zip(pipe.indices, pipe.stages, strict=True)}
    if pipe.dp_rank != 0 or pipe.tp_rank != 0:  # one replica's TP rank 0 writes; the others only take
        # part in the collectives
        parts = {}
    mine = dict(zip(parts, _without_aliases(list(parts.values()), aliases), strict=True))
    held: list[Any] = [None] * dist.get_world_size()  # per rank: stage -> [(key, bytes)]
    dist.all_gather_object(held, {i: [(key, v.numel() * v.element_size()) for key, v in part.items()]
                                  for i, part in mine.items()})
    stored: dict[str, tuple[int, int]] = {}  # key -> (the first stage holding it, its bytes)
    for i, part in sorted((i, part) for rank in held for i, part in rank.items()):
        for key, size in part:
            stored.setdefault(key, (i, size))
    root.mkdir(parents=True, exist_ok=True)
    for i, part in mine.items():
        write_shard(root / names[i], {key: value for key, value in part.items() if stored[key][0] == i})
    dist.barrier()  # every shard whole before the index names it
    if dist.get_rank() == 0:
        write_index(root, {key: names[i] for key, (i, _) in stored.items()}, sum(b for _, b in stored.values()))
        _write_configs(root, config, generation)
    dist.barrier()
    return root / "model.safetensors.index.json"

