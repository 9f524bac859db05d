"""Whether a profile was measured or estimated, and from which device sheet. Torch-free.

[Note: estimated or measured] ``autopipe.profile(..., estimate="h100")`` counts each layer's
FLOPs and bytes and prices them on a device sheet instead of timing them ([Note: counted, not
timed] in autopipe/frontend/profiling/estimated/op_counts.py). Such a profile says so twice: its
``meta["estimated"]`` holds the sheet it was estimated from (its numbers, without their
sources), and every row names that sheet in the column ``estimated`` (a measured profile has no
such column, or "" in it). A profile is all measured or all estimated from one sheet: a table
mixing the two, or rows of two sheets, or rows and metadata that disagree, is refused in one
line when the Profile is made (a layer's time from one device beside another's from a sheet
would be planned as if they were one device's). A plan made from it records the sheet
(``Plan.estimated_from``) and ``plan.explain()`` says so in its first line; ``partition``
limits its devices to the sheet's memory unless given ``memory_limit``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autopipe.errors import ProfileError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ESTIMATED", "check_estimated", "estimated_from", "estimate_text", "sheet_memory"]

ESTIMATED = "estimated"  # the column (a row's sheet name, "" where measured) and the meta key


def estimated_from(meta: Mapping[str, Any]) -> str | None:
    """The name of the sheet a profile was estimated from; None for a measured profile."""
    sheet = meta.get(ESTIMATED)
    if sheet is None:
        return None
    if not isinstance(sheet, Mapping) or not isinstance(sheet.get("name"), str) or not sheet["name"]:
        raise ProfileError(f"meta['estimated'] must be the device sheet the profile was estimated from "
                           f"(an object with its 'name'), got {sheet!r}; estimate it again "
                           "(autopipe profile MODEL --estimate SHEET)")
    return str(sheet["name"])


def estimate_text(meta: Mapping[str, Any]) -> str | None:
    """``"h100 (NVIDIA H100 SXM5 80GB)"``: the sheet an estimated profile came from, in words;
    None for a measured one."""
    name = estimated_from(meta)
    if name is None:
        return None
    device = meta[ESTIMATED].get("device")
    return f"{name} ({device})" if isinstance(device, str) and device and device != name else name


def sheet_memory(meta: Mapping[str, Any]) -> int | None:
    """The device memory of the sheet an estimated profile came from (what ``partition`` limits
    each device to unless told otherwise); None for a measured profile."""
    if estimated_from(meta) is None:
        return None
    memory = meta[ESTIMATED].get("memory_bytes")
    return int(memory) if isinstance(memory, int | float) and not isinstance(memory, bool) else None


def check_estimated(df: pd.DataFrame, meta: Mapping[str, Any]) -> pd.DataFrame:
    """[Note: estimated or measured] ``df`` itself, unless its rows mix measured and estimated
    ones, or sheets, or disagree with what the metadata names: then one ProfileError line
    naming the profile (``meta["_source"]``, its file, where it was loaded)."""
    where = str(meta.get("_source", "the profile"))
    named = estimated_from(meta)
    rows = [str(x) for x in df[ESTIMATED].fillna("")] if ESTIMATED in df.columns else [""] * len(df)
    layers = [str(x) for x in df["layer"]]
    sheets = sorted(set(rows) - {""})
    fix = ("profile the whole model one way: measured (autopipe profile MODEL) or estimated "
           "(autopipe profile MODEL --estimate SHEET)")
    if sheets and "" in rows:
        measured, estimated = rows.index(""), rows.index(sheets[0])
        raise ProfileError(f"{where} mixes measured rows (layer {layers[measured]!r}) and rows estimated from "
                           f"device sheet {sheets[0]!r} (layer {layers[estimated]!r}); {fix}")
    if len(sheets) > 1:
        raise ProfileError(f"{where} mixes rows estimated from device sheets {sheets[0]!r} and {sheets[1]!r}; "
                           f"estimate every layer on one sheet")
    if sheets and named != sheets[0]:
        says = f"meta says device sheet {named!r}" if named else "meta says it was measured"
        raise ProfileError(f"{where}: its rows were estimated from device sheet {sheets[0]!r} but its {says}; {fix}")
    if named is not None and not sheets:
        raise ProfileError(f"{where}: meta says it was estimated from device sheet {named!r} but its rows were "
                           f"measured (no 'estimated' column); {fix}")
    return df
