"""A Profile at another micro-batch size: what ``chunks="auto"`` plans with.

[Note: micro-batch scaling] A Profile describes one micro-batch ([Note: graphs are keyed to the
micro-batch]); with ``B`` rows per mini-batch and ``M`` micro-batches a plan's micro-batch has
``ceil(B / M)`` rows. The per-layer quantities that depend on the rows are ``fwd_ms``,
``bwd_ms``, ``saved_bytes`` and ``output_bytes`` (and the edges' bytes, which follow their
producer's ``output_bytes``); parameters, buffers and so optimizer state do not.

- One measured size ``r0`` (``meta["micro_batch_size"]``): every row-dependent quantity scales
  in proportion, ``value(b) = value(r0) x b / r0``. Activations are per row exactly; compute is
  modelled as per row, with no fixed cost per micro-batch, so with one size the model never
  charges more micro-batches for time, and ``chunks="auto"`` leans to many small micro-batches
  (fewer bubbles) until memory, the runtime or ``max_chunks`` stop it.
- Several measured sizes (``meta["micro_batch_sizes"]``, the base columns at
  ``meta["micro_batch_size"]`` and columns ``fwd_ms@R``, ``bwd_ms@R``, ``saved_bytes@R``,
  ``output_bytes@R`` for every other size R; see autopipe/core/profile_table.py): piecewise-linear
  interpolation between neighbouring sizes, which captures a fixed cost per micro-batch. Outside
  the measured range the nearest segment's line is extended, but never below proportional
  scaling from the smallest size (below it) nor below the largest size's value (above it).

The scaled profile's fingerprint is ``meta["fingerprints"][str(rows)]`` when the profiler
recorded one for that size, the profile's own at its own size, else ``*.STRUCTURE`` (same model,
shape not traced; see Plan.check in autopipe/core/plan.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from autopipe.core.profile_table import RETURNED_COLUMN, SPLIT_COLUMNS, WORKING_COLUMN, Profile
from autopipe.errors import ProfileError

__all__ = ["SCALED_COLUMNS", "measured_sizes", "profile_at", "rows_for", "scaled"]

SCALED_COLUMNS: tuple[str, ...] = ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes")


def measured_sizes(profile: Profile) -> list[int]:
    """The micro-batch rows ``profile`` was measured at, smallest first ([] when unrecorded)."""
    base = profile.meta.get("micro_batch_size")
    sizes = profile.meta.get("micro_batch_sizes")
    if sizes is None:
        return [base] if isinstance(base, int) and _positive_int(base) else []
    if not (isinstance(sizes, list) and sizes and all(_positive_int(r) for r in sizes)
            and len(set(sizes)) == len(sizes) and base in sizes):
        raise ProfileError(f"meta['micro_batch_sizes']={sizes!r} must list distinct row counts >= 1 "
                           f"including meta['micro_batch_size']={base!r}; re-run `autopipe profile ...`")
    for r in sizes:
        for col in SCALED_COLUMNS if r != base else ():
            name = f"{col}@{r}"
            if name not in profile.df.columns:
                raise ProfileError(f"the profile lists micro-batch size {r} but has no column "
                                   f"{name!r}; re-run `autopipe profile ...`")
            values = pd.to_numeric(profile.df[name], errors="coerce")
            if values.isna().any() or (values < 0).any():
                raise ProfileError(f"column {name!r} must hold numbers >= 0 for every layer; "
                                   f"re-run `autopipe profile ...`")
    return sorted(int(r) for r in sizes)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def scaled(sizes: Sequence[int], values: np.ndarray, rows: int) -> np.ndarray:
    """Each column of ``values`` (one row per measured size in ``sizes``, ascending) at ``rows``
    ([Note: micro-batch scaling])."""
    r = np.asarray(sizes, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if len(r) == 1:
        return v[0] * (rows / r[0])
    if rows <= r[0]:
        lo, hi = 0, 1
    elif rows >= r[-1]:
        lo, hi = len(r) - 2, len(r) - 1
    else:
        hi = int(np.searchsorted(r, rows))
        lo = hi - 1
    line = v[lo] + (v[hi] - v[lo]) * (rows - r[lo]) / (r[hi] - r[lo])
    if rows < r[0]:
        line = np.maximum(line, v[0] * (rows / r[0]))
    elif rows > r[-1]:
        line = np.maximum(line, v[-1])
    return np.maximum(line, 0.0)


def profile_at(profile: Profile, rows: int, *, batch_size: int | None = None,
               chunks: int | None = None) -> Profile:
    """``profile`` as measured at a micro-batch of ``rows`` rows (itself when that is its size)."""
    sizes = measured_sizes(profile)
    if not sizes:
        raise ProfileError("the profile does not record its micro-batch rows "
                           "(meta['micro_batch_size']), so it cannot be scaled to another "
                           "micro-batch; give chunks=M without batch_size, or re-run "
                           "`autopipe profile ...`")
    base = int(profile.meta["micro_batch_size"])
    meta = {**profile.meta, "micro_batch_size": rows}
    corrections = profile.corrections.at_rows(rows, base)  # [Note: the loss in the last stage]: per row
    if batch_size is not None:
        meta["batch_size"] = batch_size
    if chunks is not None:
        meta["chunks"] = chunks
    df = profile.df.drop(columns=[c for c in profile.df.columns if "@" in str(c)])
    if rows == base:
        return profile._derived(df, meta=meta, corrections=corrections)
    for col in SCALED_COLUMNS:
        table = np.stack([profile.df[col if r == base else f"{col}@{r}"].to_numpy(dtype=np.float64)
                          for r in sizes])
        out = scaled(sizes, table, rows)
        df[col] = out if col.endswith("_ms") else np.rint(out).astype(np.int64)
    old_saved = profile.df["saved_bytes"].to_numpy(dtype=np.float64)  # shared, inputs: the same share
    for col in ("saved_shared_bytes", "saved_input_bytes"):
        share = np.divide(profile.df[col].to_numpy(dtype=np.float64), old_saved,
                          out=np.zeros_like(old_saved), where=old_saved > 0)
        df[col] = np.rint(share * df["saved_bytes"].to_numpy()).astype(np.int64)
    ratio = {name: (new / old if old else rows / base) for name, new, old in
             zip(profile.layers, df["output_bytes"], profile.df["output_bytes"], strict=True)}
    if all(c in df.columns for c in SPLIT_COLUMNS):  # the same split of the new backward
        parts = (profile.df["bwd_input_ms"] + profile.df["bwd_weight_ms"]).to_numpy(dtype=np.float64)
        share = np.divide(profile.df["bwd_input_ms"].to_numpy(dtype=np.float64), parts,
                          out=np.ones_like(parts), where=parts > 0)
        df["bwd_input_ms"] = df["bwd_ms"].to_numpy(dtype=np.float64) * share
        df["bwd_weight_ms"] = df["bwd_ms"].to_numpy(dtype=np.float64) - df["bwd_input_ms"]
        df["weight_grad_bytes"] = np.rint(profile.df["weight_grad_bytes"].to_numpy(dtype=np.float64)
                                          * np.array([ratio[n] for n in profile.layers])).astype(np.int64)
    if WORKING_COLUMN in df.columns:  # the weights' gradients stay, the rest scales with the output
        old = profile.df[WORKING_COLUMN].to_numpy(dtype=np.float64)
        weights = np.minimum(old, profile.df["param_bytes"].to_numpy(dtype=np.float64))
        df[WORKING_COLUMN] = np.rint(weights + (old - weights) * np.array([ratio[n] for n in profile.layers])
                                     ).astype(np.int64)
    if RETURNED_COLUMN in df.columns:
        df[RETURNED_COLUMN] = np.rint(profile.df[RETURNED_COLUMN].to_numpy(dtype=np.float64)
                                      * np.array([ratio[n] for n in profile.layers])).astype(np.int64)
    edges = [(u, v, int(round(b * ratio[u]))) for u, v, b in profile.edges]
    meta["fingerprint"] = _fingerprint(profile, rows)
    return profile._derived(df, edges, meta, corrections)  # scaled from validated columns


def _fingerprint(profile: Profile, rows: int) -> str | None:
    recorded = profile.meta.get("fingerprints")
    if isinstance(recorded, dict) and isinstance(recorded.get(str(rows)), str):
        return str(recorded[str(rows)])
    structure = (profile.fingerprint or "").partition(".")[2]
    return f"*.{structure}" if structure else None


def rows_for(batch_size: int, chunks: int) -> int:
    """The rows of the first (largest) micro-batch: ``ceil(B / M)`` ([Note: micro-batch sizes])."""
    return math.ceil(batch_size / chunks)
