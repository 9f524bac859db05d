"""merge_state_dicts(): the parts each rank of a distributed pipeline saved, as one state_dict.

    parts = ["ckpt/rank0.pt", "ckpt/rank1.pt"]          # each rank's ``pipe.state_dict()``
    plain.load_state_dict(autopipe.merge_state_dicts(parts, model=plain), strict=True)

Each part holds the model's own keys for the rank's stages, and says which rank of which
pipeline saved it after which step ([Note: checkpoint parts] in executor/ranks/distributed.py), so a
merge of parts from different pipelines, steps or ranks is refused in one line.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.errors import BuildError, first_line
from executor.ranks.distributed import DistributedPipeline

__all__ = ["merge_state_dicts"]


def merge_state_dicts(
    parts: Iterable[Mapping[str, Any] | str | os.PathLike[str]], *, model: nn.Module | None = None
) -> dict[str, Any]:
    """Merge the ranks' ``pipe.state_dict()`` (dicts or ``torch.save`` paths) into one.

    A key saved by several ranks (a tied or shared weight) must hold equal tensors. Parts saved
    by :class:`executor.DistributedPipeline` say which rank of which pipeline they are
    ([Note: checkpoint parts] in executor/ranks/distributed.py): they must be one part per rank of
    one pipeline, saved after the same step. With ``model``, the result must have exactly its
    ``state_dict`` keys, so it loads with ``strict=True``.

    Raises:
        BuildError: one line naming the parts, ranks or keys at fault and what to do.
    """
    loaded = [_read_part(n, part) for n, part in enumerate(parts)]
    if not loaded:
        raise BuildError("no checkpoint parts given: pass one pipe.state_dict() (or the file "
                         "it was saved to) per rank")
    complete = _check_one_pipeline([_part_info(sd) for sd in loaded])
    merged: dict[str, Any] = {}
    holder: dict[str, int] = {}
    conflict: str | None = None
    for n, sd in enumerate(loaded):
        for key, value in sd.items():
            if key in merged:
                conflict = conflict or _conflict(key, holder[key], n, merged[key], value)
            else:
                merged[key], holder[key] = value, n
    if model is not None:  # keys of another model explain conflicting copies too: say that first
        _check_model_keys(merged, model, complete)
    if conflict:
        raise BuildError(conflict)
    return merged


def _read_part(n: int, part: Any) -> Mapping[str, Any]:
    if isinstance(part, Mapping):
        return part
    if not isinstance(part, str | os.PathLike):
        raise BuildError(f"checkpoint part {n} is a {type(part).__name__}: pass pipe.state_dict() "
                         "or the path it was saved to with torch.save")
    try:
        sd = torch.load(part, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types; all mean "not a readable checkpoint"
        raise BuildError(f"checkpoint part {n} ({os.fspath(part)}) could not be read "
                         f"({first_line(err)}); pass the files saved with "
                         "torch.save(pipe.state_dict(), path)") from None
    if not isinstance(sd, Mapping):
        raise BuildError(f"checkpoint part {n} ({os.fspath(part)}) holds a {type(sd).__name__}, "
                         "not a state_dict; pass the files saved with torch.save(pipe.state_dict(), path)")
    return sd


def _part_info(sd: Mapping[str, Any]) -> dict[str, Any] | None:
    """Which rank of which pipeline saved ``sd`` ([Note: checkpoint parts]), if it says."""
    meta = getattr(sd, "_metadata", None)
    info = meta.get(DistributedPipeline.PART_METADATA) if isinstance(meta, Mapping) else None
    return info if isinstance(info, dict) else None


def _describe(info: Mapping[str, Any]) -> str:
    return (f"rank {info['rank']} of {info['world']}, stages {info['stages']} of "
            f"{info['num_stages']}")


def _check_one_pipeline(infos: list[dict[str, Any] | None]) -> bool:
    """Refuse parts of different pipelines or steps, or twice one rank's; True when the parts
    say they are every rank's part of one pipeline."""
    known = [(n, info) for n, info in enumerate(infos) if info is not None]
    if not known:
        return False
    n0, first = known[0]
    ranks: dict[int, int] = {}
    for n, info in known:
        if (info["world"], info["num_stages"]) != (first["world"], first["num_stages"]):
            raise BuildError(f"checkpoint parts {n0} and {n} come from different pipelines "
                             f"(part {n0}: {_describe(first)}; part {n}: {_describe(info)}); "
                             "pass one part per rank of the same pipeline")
        if info["steps"] != first["steps"]:
            raise BuildError(f"checkpoint parts {n0} and {n} were saved after different steps "
                             f"({first['steps']} and {info['steps']}); save every rank's part "
                             "after the same step")
        if info["rank"] in ranks:
            raise BuildError(f"checkpoint parts {ranks[info['rank']]} and {n} are both rank "
                             f"{info['rank']}'s; pass one part per rank, ranks 0 to "
                             f"{first['world'] - 1}")
        ranks[info["rank"]] = n
    absent = sorted(set(range(first["world"])) - set(ranks))
    if absent and len(known) == len(infos):
        raise BuildError(f"got the parts of ranks {sorted(ranks)} of a {first['world']}-rank "
                         f"pipeline: the part of rank(s) {absent} is missing; pass one part per "
                         f"rank ({first['world']} in all)")
    return not absent


def _conflict(key: str, m: int, n: int, first: Any, value: Any) -> str | None:
    """Why parts ``m`` and ``n`` cannot both hold ``key`` with these values, or None."""
    if not (isinstance(first, Tensor) and isinstance(value, Tensor)):
        return None
    if first.shape != value.shape or first.dtype != value.dtype:
        return (f"checkpoint parts {m} and {n} hold {key!r} as {first.dtype} {tuple(first.shape)} "
                f"and {value.dtype} {tuple(value.shape)}: they come from pipelines of different "
                "models; pass one part per rank of the same pipeline")
    if not torch.equal(first, value):
        return (f"checkpoint part {n} disagrees with part {m} on {key!r}, a weight both ranks "
                "hold (tied or shared): its copies diverged or the parts come from different "
                "runs; save every rank's part after the same step of one run, with the same "
                "optimizer step on every rank")
    return None


def _few(keys: list[str]) -> str:
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{keys[:3]}{more}"


def _check_model_keys(merged: Mapping[str, Any], model: nn.Module, complete: bool) -> None:
    """The merged keys must be exactly ``model.state_dict()``'s, or say which and why not."""
    want = list(model.state_dict(keep_vars=True))
    saved = set(want)
    missing = [k for k in want if k not in merged]
    extra = [k for k in merged if k not in saved]
    nonpersistent = {name for name, _ in model.named_buffers(remove_duplicate=False)} - saved
    stale = [k for k in extra if k in nonpersistent]
    foreign = [k for k in extra if k not in nonpersistent]
    problems = []
    if stale:
        problems.append(
            f"{_few(stale)} are the model's non-persistent buffers (persistent=False: "
            "model.state_dict() leaves them out and the model rebuilds them), saved by an older "
            "autopipe; delete these keys from the parts, or re-save them with this version")
    if foreign:
        problems.append(f"unexpected {_few(foreign)}, which the model does not have: the parts "
                        "come from a pipeline of another model; pass the model it was built from")
    if missing:
        cause = ("every rank's part is here, so they come from a pipeline of another model; pass "
                 "the model it was built from" if complete else
                 "a rank's part is missing (pass one part per rank) or the parts come from a "
                 "pipeline of another model")
        problems.append(f"missing {_few(missing)} ({len(missing)} of {len(want)} keys), which no "
                        f"part holds: {cause}")
    if problems:
        raise BuildError("merged checkpoint does not match the model: " + "; ".join(problems))
