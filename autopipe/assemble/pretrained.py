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
model is never gathered whole. Nothing that a folder already holds is overwritten unless
``overwrite=True``; a model without a HuggingFace config (a plain ``nn.Module``) gets the weights
and the index only, which ``weights=`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from autopipe.frontend.building.weights import WeightsError, save_sharded

__all__ = ["save_pretrained", "model_configs"]

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


def _where(t: Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), int(t.storage_offset())


def save_pretrained(parts: Sequence[Mapping[str, Tensor]], configs: tuple[Any, Any, frozenset[str]],
                    folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``parts`` (each stage's tensors in the model's keys, in stage order) and the model's
    ``configs`` into ``folder`` ([Note: saved as the model]). Returns the index's path."""
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise WeightsError(f"{root} is a file, not a folder: pass a folder to save_pretrained")
    config, generation, aliases = configs
    if not overwrite:  # before anything is written: the weights' own check comes too late
        written = [root / n for n, c in zip(_CONFIG_FILES, (config, generation), strict=True) if c is not None]
        taken = [str(p) for p in written if p.exists()]
        if taken:
            raise WeightsError(f"{taken[0]} already exists: refusing to overwrite a saved model; pass "
                               "overwrite=True or choose another folder")
    root.mkdir(parents=True, exist_ok=True)
    sources = {_where(v) for part in parts for k, v in part.items() if k not in aliases}
    parts = [{k: v for k, v in part.items() if k not in aliases or _where(v) not in sources} for part in parts]
    index = save_sharded(parts, root, overwrite=overwrite)
    if config is not None:
        config.save_pretrained(root)
    if generation is not None:
        generation.save_pretrained(root)
    return index
