"""The Profile value: one row of measured costs per layer, plus the edges between layers.

A Profile is what the partitioner reads. It is measured by ``autopipe.frontend.profiling.profiler`` (torch), but it
is a plain pandas table, so it can also be written by hand or converted from another tool::

    import pandas as pd
    from autopipe import Profile, partition

    df = pd.DataFrame({
        "layer":        ["embed", "block0", "block1", "head"],
        "fwd_ms":       [0.5, 4.0, 4.0, 2.0],
        "bwd_ms":       [1.0, 8.0, 8.0, 4.0],
        "param_bytes":  [4_000_000, 12_000_000, 12_000_000, 4_000_000],
        "output_bytes": [1_000_000] * 4,
        "saved_bytes":  [1_000_000, 6_000_000, 6_000_000, 2_000_000],
    })
    prof = Profile.from_frame(df, meta={"model": "toy", "micro_batch_size": 8})
    plan = partition(prof, stages=2)

Columns (one row per layer, rows in a topological order of the layer graph; all numbers are for
ONE micro-batch):

    layer          unique layer name (the LayerGraph node name)
    fwd_ms         forward time, ms (median of the measured repeats)
    bwd_ms         backward time, ms
    param_bytes    bytes of the layer's parameters
    output_bytes   bytes of the layer's output activation(s)
    saved_bytes    bytes the layer keeps alive for its backward pass
    buffer_bytes   optional: bytes of buffers (running stats ...), default 0
    saved_shared_bytes  optional: of ``saved_bytes``, the inputs its producers already save as
                   their outputs (one tensor, counted once: [Note: saved once]), default 0
    saved_input_bytes  optional: of ``saved_bytes``, the layer's inputs from other layers (not
                   the caller's batch): where the layer starts a stage, the input the stage
                   keeps to recompute from ([Note: an input kept once] in stage_memory.py), default 0
    peak_bytes     optional: measured peak memory, may be NaN
    bwd_working_bytes, returned_bytes   optional: the most bytes one backward of the layer has
                   alive beyond what it starts from ([Note: the backward's memory] in
                   backward_memory.py; without it: every gradient from the start, no working
                   set), and of ``output_bytes`` what the model returns ([Note: the loss's
                   memory]; without it: the outputs of the layers nothing reads)
    tie_group      optional: layers sharing a parameter carry the same non-empty id, default "".
                   The shared bytes are the largest ``param_bytes`` in the group, so give the
                   shared parameter's bytes on every member (or on one member and 0 elsewhere).
    kind, module_type, estimated   optional text: "call_module", "nn.Linear", the device sheet a
                   row was estimated from ([Note: estimated or measured] in estimated.py)
    tp_role, tp_group, tp_divides   optional: tensor parallelism ([Note: tensor-parallel cost])
    bwd_input_ms, bwd_weight_ms, weight_grad_bytes   optional, all three or none: the backward
                   split as torch.distributed.pipelining's zero-bubble schedules run it, into
                   the gradients of the layer's inputs and of its weights (their sum is
                   ``bwd_ms``: the profiler scales the measured pair to it and records the
                   measured (I + W) / bwd as ``meta["bwd_split_ratio"]``), and the bytes the
                   weight pass starts from, held from the first to the second ([Note: split
                   backward time] in autopipe/core/cost.py). Without them the planner refuses
                   the zero-bubble schedules in one line (profile again)

``edges`` lists ``(src_layer, dst_layer, bytes)`` for every tensor passed between layers (graph
inputs are not layers and have no edges). ``meta`` records how the profile was measured: device,
dtype, micro_batch_size, batch_size, chunks, torch_version, fingerprint, repeats, warmup, date,
model. ``corrections`` holds what was measured besides the layers (stage calls per runtime, the
loss, the transfer, ...): autopipe.core.corrections ([Note: one profile, two runtimes]).

Several micro-batch sizes: the columns above hold the measurements at ``meta["micro_batch_size"]``
rows; measurements at other sizes R are extra columns ``fwd_ms@R``, ``bwd_ms@R``,
``saved_bytes@R`` and ``output_bytes@R`` (the row-dependent ones; parameters and buffers are the
same at every size), with ``meta["micro_batch_sizes"]`` listing every measured size (the base
one included) and, optionally, ``meta["fingerprints"] = {"R": fingerprint}`` the graph's
fingerprint at each. Edges keep the base size's bytes. ``autopipe.core.scaling.profile_at``
reads them ([Note: micro-batch scaling]); a profile of one size scales in proportion to the rows.

On disk a profile is ``NAME.csv`` (the table) with ``NAME.json`` beside it (edges, meta and
corrections; a side file without ``"corrections"``, from an earlier release, keeps them as flat
``meta`` keys, which :meth:`Corrections.from_legacy_meta` reads).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from autopipe.core.atomic_files import atomic_write_text
from autopipe.core.corrections import Corrections, is_legacy_key
from autopipe.core.estimated import check_estimated
from autopipe.errors import ProfileError

if TYPE_CHECKING:  # imported where a table is built or read: a plan alone never loads pandas
    import pandas as pd

__all__ = ["Profile", "RETURNED_COLUMN", "SPLIT_COLUMNS", "WORKING_COLUMN", "fingerprint_mismatch", "micro_batch_text"]

# A backward's input- and weight-gradient parts and what W starts from: optional, all or none.
SPLIT_COLUMNS: tuple[str, ...] = ("bwd_input_ms", "bwd_weight_ms", "weight_grad_bytes")
# optional, measured since issue 41: [Note: the backward's memory], [Note: the loss's memory]
WORKING_COLUMN, RETURNED_COLUMN = "bwd_working_bytes", "returned_bytes"

_RERUN = "re-run `autopipe profile ...`"
_FROM_META = Corrections()  # not given: read from the flat meta keys of earlier releases

def _paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = Path(path)
    if p.suffix in (".csv", ".json"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".csv"), p.with_name(p.name + ".json")


@dataclass
class Profile:
    """Measured per-layer costs of one model at one micro-batch size (see the module docstring).

    Build one with :meth:`from_frame` (hand-written tables), :meth:`load` (from disk) or
    ``autopipe.profile(...)`` (measured). Construction validates the table and edges and raises
    :class:`~autopipe.errors.ProfileError` on bad input.
    """

    df: pd.DataFrame
    edges: list[tuple[str, str, int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # what was measured besides the layers ([Note: one profile, two runtimes]); not given, it is
    # read from ``meta``'s flat keys as earlier releases saved them, which then leave ``meta``
    corrections: Corrections = _FROM_META

    REQUIRED_COLUMNS: ClassVar[tuple[str, ...]] = ("layer", "fwd_ms", "bwd_ms", "param_bytes", "output_bytes",
                                                   "saved_bytes")
    NUMERIC_OPTIONAL: ClassVar[tuple[str, ...]] = ("buffer_bytes", "peak_bytes", "saved_shared_bytes",
                                                   "saved_input_bytes", "tp_divides")
    TEXT_OPTIONAL: ClassVar[tuple[str, ...]] = ("tie_group", "kind", "module_type", "measured_as", "tp_role", "tp_group")

    def __post_init__(self) -> None:
        self.df = check_estimated(_validate_frame(self.df, where=str(self.meta.get("_source", "profile"))), self.meta)
        self.edges = _validate_edges(self.edges, self.layers)
        flat = [k for k in self.meta if is_legacy_key(k)]
        if not isinstance(self.corrections, Corrections):
            raise ProfileError(f"corrections must be a Corrections, got {type(self.corrections).__name__}")
        if self.corrections is _FROM_META:
            self.corrections = Corrections.from_legacy_meta(self.meta)
        elif flat:
            raise ProfileError(f"meta holds {flat[0]!r} and corrections= was given too; a measured correction "
                               "belongs in Corrections only (dataclasses.replace(profile.corrections, ...))")
        self.meta = {k: v for k, v in self.meta.items() if k != "_source" and not is_legacy_key(k)}

    # --- views ------------------------------------------------------------------------------
    @property
    def layers(self) -> list[str]:
        """Layer names in topological order."""
        return [str(x) for x in self.df["layer"]]

    @property
    def fingerprint(self) -> str | None:
        """Hash of the graph structure and shapes this profile was measured on, if known."""
        fp = self.meta.get("fingerprint")
        return None if fp is None else str(fp)

    @property
    def device(self) -> str:
        return str(self.meta.get("device", "unknown"))

    def __len__(self) -> int:
        return len(self.df)

    def for_runtime(self, runtime: str | None) -> Profile:
        """This profile as ``runtime`` (``"gpipe"``, ``"distributed"``; None: the profile's
        default) sees it: :meth:`Corrections.for_runtime`."""
        chosen = self.corrections.default_runtime() if runtime is None else runtime
        return self._derived(corrections=self.corrections.for_runtime(chosen))

    def _derived(self, df: pd.DataFrame | None = None, edges: list[tuple[str, str, int]] | None = None,
                meta: dict[str, Any] | None = None, corrections: Corrections | None = None) -> Profile:
        """A profile computed from this one: what is not given is copied from it, and nothing is
        validated again. For computations on a profile that was validated when it was built
        (:meth:`for_runtime`, ``scaling.profile_at``): the planner derives one per solve, and
        validating a frame costs milliseconds; a table from outside goes through the constructor."""
        new = copy.copy(self)
        new.df = (self.df if df is None else df).copy()
        new.edges = list(self.edges if edges is None else edges)
        new.meta = dict(self.meta if meta is None else meta)
        new.corrections = self.corrections if corrections is None else corrections
        return new

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_frame(
        cls,
        df: pd.DataFrame,
        edges: Sequence[tuple[str, str, int]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Profile:
        """Profile from a hand-written or converted table.

        Missing optional columns are filled (``buffer_bytes`` 0, ``peak_bytes`` NaN, text
        columns ""). Without ``edges`` the layers form a chain in row order, each edge carrying
        the producer's ``output_bytes``.
        """
        import pandas as pd

        if not isinstance(df, pd.DataFrame):
            raise ProfileError(f"from_frame needs a pandas DataFrame, got {type(df).__name__}")
        frame = df.reset_index(drop=True).copy()
        if edges is None and "layer" in frame.columns and "output_bytes" in frame.columns:
            names = [str(x) for x in frame["layer"]]
            out = list(frame["output_bytes"])
            edges = [(names[i], names[i + 1], _as_int(out[i])) for i in range(len(names) - 1)]
        return cls(frame, list(edges or []), dict(meta or {}))

    def check_fingerprint(self, fingerprint: str | None, what: str = "model") -> None:
        """Raise ProfileError if this profile was measured on a different graph, saying whether
        the model or only the micro-batch shape differs (see :func:`fingerprint_mismatch`)."""
        mine = self.fingerprint
        differs = fingerprint_mismatch(mine, fingerprint)
        if differs is None:
            return
        head = f"profile fingerprint {mine} does not match the {what}'s fingerprint {fingerprint}"
        if differs == "model":
            raise ProfileError(
                f"{head}: the profile was measured on another model (its layers or parameter "
                f"shapes differ); re-run autopipe profile for this model"
            )
        if differs == "shape":
            raise ProfileError(
                f"{head}: same model, another micro-batch shape (the profile's micro-batch is "
                f"{micro_batch_text(self.meta)}); use that batch size and chunks, or re-run "
                f"autopipe profile for this batch and chunks"
            )
        raise ProfileError(
            f"{head}: the profile was measured on a different graph (another model or micro-batch "
            f"shape); re-run autopipe profile for this model/batch"
        )

    # --- disk -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``NAME.csv`` and ``NAME.json``; returns the CSV path.

        Refuses to replace existing files unless ``overwrite=True``; each file is written
        atomically, so a failure never leaves a half-written profile.
        """
        csv_path, json_path = _paths(path)
        if not overwrite:
            for p in (csv_path, json_path):
                if p.exists():
                    raise ProfileError(
                        f"{p} already exists: refusing to overwrite a saved profile; "
                        f"pass --force / overwrite=True or choose another name"
                    )
        side = {"meta": _jsonable(self.meta), "edges": [[s, d, int(b)] for s, d, b in self.edges],
                "corrections": self.corrections.to_json()}
        json_text = json.dumps(side, indent=2, sort_keys=True) + "\n"
        atomic_write_text(csv_path, self.df.to_csv(index=False))
        atomic_write_text(json_path, json_text)
        return csv_path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile from ``NAME.csv``, ``NAME.json`` or ``NAME`` (both files needed)."""
        import pandas as pd

        csv_path, json_path = _paths(path)
        for p in (csv_path, json_path):
            if not p.exists():
                raise ProfileError(f"{p} does not exist: a profile is NAME.csv + NAME.json; {_RERUN}")
        try:
            df = pd.read_csv(csv_path, keep_default_na=False, na_values={"peak_bytes": ["", "nan", "NaN"]})
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ProfileError(f"{csv_path} is not a valid profile CSV: {first}; {_RERUN}") from None
        try:
            side = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ProfileError(
                f"{json_path} is not valid JSON (line {err.lineno}): {err.msg}; {_RERUN}"
            ) from None
        if not isinstance(side, dict) or not isinstance(side.get("edges", []), list):
            raise ProfileError(f"{json_path} must hold an object with 'meta' and 'edges'; {_RERUN}")
        meta = side.get("meta", {})
        if not isinstance(meta, dict):
            raise ProfileError(f"{json_path}: 'meta' must be an object; {_RERUN}")
        edges: list[tuple[str, str, int]] = []
        for e in side.get("edges", []):
            if not (isinstance(e, list) and len(e) == 3 and isinstance(e[2], int | float)):
                raise ProfileError(f"{json_path}: edge {e!r} is not [src, dst, bytes]; {_RERUN}")
            edges.append((str(e[0]), str(e[1]), int(e[2])))
        if "corrections" not in side:  # saved before corrections had their own object
            return cls(df, edges, {**meta, "_source": str(csv_path)})
        corrections = Corrections.from_json(side["corrections"], f"{json_path}: corrections")
        return cls(df, edges, {**meta, "_source": str(csv_path)}, corrections)


def fingerprint_mismatch(made_for: str | None, other: str | None) -> str | None:
    """What differs between the graph a profile or plan was made for and ``other``'s graph.

    None when they match or either is unknown; ``"model"`` when the layers or their parameter
    shapes differ; ``"shape"`` when only the shapes flowing through them do (another
    micro-batch); ``"graph"`` when an older one-part fingerprint cannot tell which. Fingerprints
    are ``FULL.STRUCTURE`` ([Note: two-part fingerprint] in autopipe/frontend/tracing/graph.py); FULL
    alone decides whether they match, so files from before the STRUCTURE part still do.
    """
    if made_for is None or other is None:
        return None
    full_a, _, structure_a = made_for.partition(".")
    full_b, _, structure_b = other.partition(".")
    if full_a == full_b:
        return None
    if not structure_a or not structure_b:
        return "graph"
    return "model" if structure_a != structure_b else "shape"


def micro_batch_text(meta: dict[str, Any]) -> str:
    """``"64 rows (batch 256 in 4 chunks)"`` from a profile's or plan's record, as far as known."""
    micro, batch, chunks = (meta.get(k) for k in ("micro_batch_size", "batch_size", "chunks"))
    if micro is None:
        return "unrecorded"
    return f"{micro} rows" + (f" (batch {batch} in {chunks} chunks)" if batch and chunks else "")


def _as_int(x: Any) -> int:
    return int(x) if not (isinstance(x, float) and math.isnan(x)) else 0


def _jsonable(meta: dict[str, Any]) -> dict[str, Any]:
    return {str(k): (v if isinstance(v, str | int | float | bool | list | dict | type(None)) else str(v))
            for k, v in meta.items()}


def _validate_frame(df: pd.DataFrame, where: str) -> pd.DataFrame:
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise ProfileError(f"{where}: df must be a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in Profile.REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ProfileError(
            f"{where} lacks required column(s) {missing}; a profile needs "
            f"{list(Profile.REQUIRED_COLUMNS)}; {_RERUN}"
        )
    if len(df) == 0:
        raise ProfileError(f"{where} has no layers (empty table); {_RERUN}")
    df = df.reset_index(drop=True).copy()
    df["layer"] = df["layer"].astype(str)
    dup = df["layer"][df["layer"].duplicated()].tolist()
    if dup:
        raise ProfileError(f"{where}: layer names must be unique, {dup[:3]} repeat; {_RERUN}")
    for col in Profile.REQUIRED_COLUMNS[1:] + Profile.NUMERIC_OPTIONAL:
        if col not in df.columns:
            df[col] = float("nan") if col == "peak_bytes" else 0
        values = pd.to_numeric(df[col], errors="coerce")
        bad = values.isna() if col != "peak_bytes" else values.isna() & df[col].notna()
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise ProfileError(
                f"{where}: column {col!r} must be numeric without blanks, row {row} "
                f"(layer {df['layer'][row]!r}) holds {df[col][row]!r}; {_RERUN}"
            )
        if (values < 0).any():
            row = int((values < 0).to_numpy().argmax())
            raise ProfileError(
                f"{where}: column {col!r} must be non-negative, layer {df['layer'][row]!r} has "
                f"{values[row]}; {_RERUN}"
            )
        df[col] = values.astype(float) if col.endswith("_ms") or col == "peak_bytes" else values.astype("int64")
    present = [c for c in SPLIT_COLUMNS if c in df.columns]
    if present and len(present) < len(SPLIT_COLUMNS):
        missing = [c for c in SPLIT_COLUMNS if c not in df.columns]
        raise ProfileError(f"{where} has {present} but not {missing}: the split backward takes all of "
                           f"{list(SPLIT_COLUMNS)} or none; {_RERUN}")
    for col in [*present, *(c for c in (WORKING_COLUMN, RETURNED_COLUMN) if c in df.columns)]:
        values = pd.to_numeric(df[col], errors="coerce")
        if values.isna().any() or (values < 0).any():
            row = int((values.isna() | (values < 0)).to_numpy().argmax())
            raise ProfileError(f"{where}: column {col!r} must hold numbers >= 0, layer {df['layer'][row]!r} "
                               f"has {df[col][row]!r}; {_RERUN}")
        df[col] = values.astype(float) if col.endswith("_ms") else values.astype("int64")
    for col in Profile.TEXT_OPTIONAL:
        if col not in df.columns:
            df[col] = ""
        df[col] = df[col].fillna("").astype(str)
    return df


def _validate_edges(edges: Sequence[tuple[str, str, int]], layers: list[str]) -> list[tuple[str, str, int]]:
    index = {name: i for i, name in enumerate(layers)}
    out: list[tuple[str, str, int]] = []
    for edge in edges:
        if len(edge) != 3:
            raise ProfileError(f"edge {edge!r} must be (src_layer, dst_layer, bytes); {_RERUN}")
        src, dst, nbytes = str(edge[0]), str(edge[1]), int(edge[2])
        for name in (src, dst):
            if name not in index:
                raise ProfileError(f"edge ({src!r}, {dst!r}) names unknown layer {name!r}; {_RERUN}")
        if index[src] >= index[dst]:
            raise ProfileError(
                f"edge ({src!r}, {dst!r}) goes backwards: rows must be in topological order; {_RERUN}"
            )
        if nbytes < 0:
            raise ProfileError(f"edge ({src!r}, {dst!r}) has negative bytes {nbytes}; {_RERUN}")
        out.append((src, dst, nbytes))
    return out
