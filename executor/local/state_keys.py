"""A one-process pipeline's ``state_dict`` under the original model's keys ([Note: state_dict
keys] in executor/local/gpipe.py): hooks that drop the ``stages.N.`` prefix on save, put it back on
load, and report missing / unexpected keys and size mismatches as the model itself would.

The hooks read the module's ``stages`` (an ``nn.ModuleList``) and ``key_prefixes`` (one per stage).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["STAGES_PREFIX", "original_keys", "unprefix_state_dict", "prefix_state_dict",
           "unprefix_incompatible_keys"]

STAGES_PREFIX = "stages."


def _split_key(module: Any, key: str, prefix: str) -> tuple[int, str] | None:
    """``prefix + "stages.3.net.0.weight"`` -> (3, original key) for keys of this pipeline."""
    if not key.startswith(prefix + STAGES_PREFIX):
        return None
    index, _, local = key[len(prefix) + len(STAGES_PREFIX) :].partition(".")
    if not index.isdigit() or int(index) >= len(module.stages):
        return None
    return int(index), module.key_prefixes[int(index)] + local


def unprefix_state_dict(module: Any, state_dict: Any, prefix: str, _meta: Any) -> None:
    for key in list(state_dict):
        split = _split_key(module, key, prefix)
        if split is not None:
            value = state_dict.pop(key)
            state_dict.setdefault(prefix + split[1], value)  # a tie appears once


def original_keys(module: Any) -> dict[str, list[str]]:
    """Original key -> the ``stages.N.local`` keys holding it (several for a tie)."""
    owners: dict[str, list[str]] = {}
    for j, stage in enumerate(module.stages):
        for local in stage.state_dict(keep_vars=True):
            owners.setdefault(module.key_prefixes[j] + local, []).append(f"{STAGES_PREFIX}{j}.{local}")
    return owners


def prefix_state_dict(
    module: Any, state_dict: Any, prefix: str, _meta: Any, _strict: bool,
    _missing: list[str], _unexpected: list[str], error_msgs: list[str],
) -> None:
    # for _unprefix_incompatible_keys, which gets neither the prefix nor the error messages
    module._load_prefix, module._load_errors = prefix, error_msgs
    owners = original_keys(module)
    for key in list(state_dict):
        if not key.startswith(prefix) or key.startswith(prefix + STAGES_PREFIX):
            continue
        targets = owners.get(key[len(prefix) :])
        if targets:
            value = state_dict.pop(key)
            for target in targets:
                state_dict[prefix + target] = value


def unprefix_incompatible_keys(module: Any, incompatible: Any) -> None:
    """Missing and unexpected keys, and the errors (size mismatch for ...), in original keys."""
    prefix, errors = module._load_prefix, module._load_errors
    module._load_errors = []
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        renamed = []
        for key in keys:
            split = _split_key(module, key, prefix)
            renamed.append(key if split is None else prefix + split[1])
        keys[:] = list(dict.fromkeys(renamed))
    if not errors:
        return
    original = {prefix + local: prefix + key
                for key, locals_ in original_keys(module).items() for local in locals_}
    longest_first = sorted(original, key=len, reverse=True)  # stages.0.ab before stages.0.a
    pattern = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    errors[:] = list(dict.fromkeys(pattern.sub(lambda m: original[m.group(0)], e) for e in errors))
