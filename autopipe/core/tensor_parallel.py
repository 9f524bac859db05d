"""Tensor parallelism: the roles a profile's layers play and what a degree t costs each rank.

[Note: tensor-parallel cost] A profile's columns ``tp_role``, ``tp_group`` and ``tp_divides``
say per layer what the tracer found ([Note: tensor-parallel structure] in
autopipe/frontend/tracing/tensor_parallel.py): ``column`` / ``row`` (the Linears of a group),
``sharded`` (the parameter-free ops between them, attention included), ``vocab_embedding`` /
``vocab_head`` (the vocabulary split), ``replicated`` (the rest); the group's name; the number
the degree must divide (heads, features, vocabulary). A profile without the columns, or with
"" in them (older ones, hand-made tables), knows no roles and plans tensor_parallel=1 only.

At degree t each of the t ranks of a group runs every layer, a TP-able one on 1/t of it. The
per-rank profile (``at_degree``) is the profile with, per layer, by role:

- compute (``fwd_ms``, ``bwd_ms`` and its split parts, at every measured size) over t where
  the role splits compute: every role but ``replicated``;
- parameters (``param_bytes``, so gradients and optimizer state) over t where it splits
  weights: ``column``, ``row``, ``vocab_*`` (a row's bias is counted split too: it is 1/in of
  the weight);
- saved activations (``saved_bytes`` and its shared / input shares, ``weight_grad_bytes``) over
  t where the layer saves split values: ``row`` (its input) and ``sharded``; a column and the
  head save their full input, replicated layers their full values;
- outputs (``output_bytes``, ``returned_bytes``, the edges they send) over t where the output is
  split: ``column``, ``sharded``; the backward's working set splits its parameter part with the
  weights and the rest with the output, as micro-batch scaling splits it. The head's logits
  are all-gathered into the whole vocabulary before the loss, as the runtime does ([Note:
  tensor parallelism on ranks]): its output and the loss are whole on every rank, the gather
  (``(t - 1) / t x bytes / bandwidth + (t - 1) x latency``) in its forward;
- collectives, a ring all-reduce over the t ranks of one host's link each (``allreduce_ms``:
  ``2 (t - 1) / t x bytes / bandwidth + 2 (t - 1) x latency``), added to the layer that waits
  for it, so recomputation repeats it, a split backward's input half holds it and the simulator
  charges it on the critical path like any compute: a ``row``'s output and a
  ``vocab_embedding``'s output in the forward (Megatron's g), a group's input gradient in the
  backward of its first column (f: q, k and v sum theirs first), and the head's input gradient.
  The group's input is the largest value its columns receive from outside it (graph inputs need
  no gradient), at another micro-batch size in proportion to the row's output.

[Note: sequence parallelism] (Korthikanti et al. 2022.) A ``sequence`` layer is one the
tracer found between groups on the tokens' own path (norms, residual adds, dropout: each token
apart, [Note: tensor-parallel structure]): replicated at degree t, but under
``sequence_parallel=True`` each rank of the group runs it on 1/t of the tokens. The row's
all-reduce is then a reduce-scatter over the tokens (its output split), the vocabulary
embedding's too, and a group's f (and the head's) an all-gather of its input, its gradient
reduce-scattered. So, per rank, on top of the degree's own splits:

- a ``sequence`` layer's compute, saves and outputs are over t, like a ``sharded`` one's;
- a ``row``'s and the ``vocab_embedding``'s outputs are over t (and the cuts and receive
  buffers that carry them);
- the collectives move what they moved: a ring all-reduce is a reduce-scatter and then an
  all-gather, so each group's forward pair (the row's reduce-scatter, the next column's
  all-gather) is charged as the all-reduce was, at the row, and its backward pair at the first
  column; a column still saves its whole input (the gathered one);
- the gradients of a ``sequence`` layer's parameters (the norms') are partial on each rank and
  all-reduced over the group once per step; they are small and not charged.

The runtime ([Note: tensor parallelism on ranks]) needs the tokens (the residual stream's
second-to-last dimension) to divide by t. A profile without ``sequence`` roles (made before
they were looked for) refuses ``sequence_parallel=True`` (:func:`check_sequence`).

The TP link: an estimated profile's sheet's ``intra_host_bandwidth`` (a TP group stays inside a
host) with no latency; a measured one's the plan's bandwidth and the profile's measured latency.
A vocabulary the degree does not divide stays replicated; any other group refuses the degree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autopipe.core.data_parallel import allreduce_ms, ring_ms
from autopipe.core.estimated import ESTIMATED, estimated_from
from autopipe.errors import PartitionError

if TYPE_CHECKING:
    from autopipe.core.profile_table import Profile

__all__ = ["COLUMN", "ROW", "SHARDED", "VOCAB_EMBEDDING", "VOCAB_HEAD", "REPLICATED", "SEQUENCE", "ROLES",
           "VOCAB_GROUP", "ROLE_COLUMNS", "LayerRole", "Link", "groups", "structure_text",
           "degrees", "degree_refusal", "check_degree", "check_sequence", "tp_link", "tp_allreduce_ms", "tp_allgather_ms",
           "at_degree"]

COLUMN, ROW, SHARDED = "column", "row", "sharded"
VOCAB_EMBEDDING, VOCAB_HEAD, REPLICATED = "vocab_embedding", "vocab_head", "replicated"
SEQUENCE = "sequence"  # replicated, or split by tokens under sequence parallelism
ROLES: tuple[str, ...] = (COLUMN, ROW, SHARDED, VOCAB_EMBEDDING, VOCAB_HEAD, REPLICATED, SEQUENCE)
VOCAB_GROUP = "vocab"
ROLE_COLUMNS: tuple[str, ...] = ("tp_role", "tp_group", "tp_divides")

SPLITS_COMPUTE = frozenset({COLUMN, ROW, SHARDED, VOCAB_EMBEDDING, VOCAB_HEAD, SEQUENCE})
SPLITS_PARAMS = frozenset({COLUMN, ROW, VOCAB_EMBEDDING, VOCAB_HEAD})
SPLITS_SAVED = frozenset({ROW, SHARDED, SEQUENCE})  # SEQUENCE: a role under sequence parallelism only
SPLITS_OUTPUT = frozenset({COLUMN, SHARDED, SEQUENCE})
SCATTERED = frozenset({ROW, VOCAB_EMBEDDING})  # outputs reduce-scattered under sequence parallelism
_TIMES = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms")
_SAVES = ("saved_bytes", "saved_shared_bytes", "saved_input_bytes", "weight_grad_bytes")
_OUTPUTS = ("output_bytes", "returned_bytes")


@dataclass(frozen=True)
class LayerRole:
    """One layer's part in tensor parallelism: its role, its group ("" when replicated) and
    the number a degree must divide (0: none)."""

    role: str
    group: str = ""
    divides: int = 0


@dataclass(frozen=True)
class Link:
    """The TP group's link: ms per byte and latency per message, one way."""

    ms_per_byte: float
    latency_ms: float = 0.0


def _roles(profile: Profile) -> list[LayerRole] | None:
    """Per layer its role; None when the profile records none (older, or hand-made)."""
    df = profile.df
    if "tp_role" not in df.columns or not any(str(r) for r in df["tp_role"]):
        return None
    group = df["tp_group"] if "tp_group" in df.columns else [""] * len(df)
    divides = df["tp_divides"] if "tp_divides" in df.columns else [0] * len(df)
    out = []
    for role, grp, div in zip(df["tp_role"], group, divides, strict=True):
        role = str(role) or REPLICATED
        if role not in ROLES:
            raise PartitionError(f"the profile's tp_role {role!r} is unknown (roles: {list(ROLES)}); "
                                 "re-run `autopipe profile ...`")
        out.append(LayerRole(role, str(grp), int(div or 0)))
    return out


def groups(profile: Profile) -> dict[str, int] | None:
    """Each group the profile's layers form and its divisor; None when it records no roles."""
    roles = _roles(profile)
    if roles is None:
        return None
    return {r.group: r.divides for r in roles if r.group}


def structure_text(profile: Profile) -> str:
    """The tensor-parallel structure in one line, for the profile's summary."""
    found = groups(profile)
    if found is None:
        return "tensor parallel: not recorded (a profile from before it was looked for); profile again to plan it"
    if not found:
        return ("tensor parallel: none found (no column -> row Linear pair, no vocabulary): plans "
                "use tensor_parallel=1")
    kinds: dict[str, list[int]] = {}
    for name, div in found.items():
        kinds.setdefault(name.split(":")[0], []).append(div)
    parts = [f"{len(d)} {kind} group(s) (degree divides {math.gcd(*d)})" if kind != VOCAB_GROUP
             else f"vocabulary {d[0]} split" for kind, d in kinds.items()]
    return "tensor parallel: " + ", ".join(parts) + "; column tp_role says each layer's part"


def _required(found: Mapping[str, int]) -> dict[str, int]:
    return {name: div for name, div in found.items() if name != VOCAB_GROUP and div > 0}


def degrees(profile: Profile, devices: int, host: int | None) -> list[int]:
    """The degrees ``tensor_parallel="auto"`` tries: those dividing the devices and the host
    (None: all on one) and every group's divisor (1 alone for a model without TP structure)."""
    found = groups(profile) or {}
    need = _required(found)
    host = devices if host is None else host
    if not found:
        return [1]
    return [t for t in range(1, min(devices, host) + 1)
            if devices % t == 0 and host % t == 0 and all(d % t == 0 for d in need.values())]


def degree_refusal(found: Mapping[str, int], degree: int) -> str | None:
    """The one line for a degree > 1 that the groups ``found`` (group -> divisor) cannot take:
    none at all, or one whose heads or features it does not divide; None when they take it (the
    planner's check and the runtime's)."""
    if not found:
        return (f"tensor_parallel={degree}: the model has no tensor-parallel structure (no column -> row "
                "Linear pair, no vocabulary; every layer is replicated); use tensor_parallel=1")
    for name, div in _required(found).items():
        if div % degree:
            what = (f"the heads and kv heads of group {name} (their greatest common divisor is {div})"
                    if name.startswith("attention") else f"the {div} features of group {name}")
            ok = [t for t in range(1, min(div, 64) + 1) if div % t == 0]
            return f"tensor_parallel={degree} does not divide {what}; use one of {ok}"
    return None


def check_degree(profile: Profile, degree: Any, devices: int | None, host: int | None) -> None:
    """One PartitionError line for a degree this profile or these devices cannot take."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise PartitionError(f"tensor_parallel={degree!r}: need an integer degree >= 1 or 'auto'")
    if degree == 1:
        return
    found = groups(profile)
    if found is None:
        raise PartitionError(f"tensor_parallel={degree}: the profile records no tensor-parallel roles "
                             "(made before autopipe looked for them, or by hand); re-run `autopipe profile ...`")
    line = degree_refusal(found, degree)
    if line:
        raise PartitionError(line)
    if host is not None and (degree > host or host % degree):
        raise PartitionError(f"tensor_parallel={degree} spans hosts of {host} devices: a TP group "
                             f"all-reduces every layer and stays inside one host; use a divisor of "
                             f"{host} (devices_per_host={host})")
    if devices is not None and devices % degree:
        raise PartitionError(f"tensor_parallel={degree} does not divide the {devices} devices "
                             f"(PP x TP x DP); use a divisor of {devices}")


def tp_link(profile: Profile, bandwidth: float | None) -> Link:
    """The link a TP group all-reduces over: the sheet's intra-host one for an estimated profile,
    else ``bandwidth`` (the plan's, bytes/s; None or 0: free) and the measured latency."""
    if estimated_from(profile.meta) is not None:
        intra = profile.meta[ESTIMATED].get("intra_host_bandwidth")
        if isinstance(intra, int | float) and intra > 0:
            return Link(1e3 / float(intra))
    t = profile.corrections.transfer
    return Link(1e3 / bandwidth if bandwidth else 0.0, 0.0 if t is None else float(t.latency_ms))


def tp_allreduce_ms(nbytes: Any, degree: int, link: Link) -> Any:
    """A ring all-reduce of ``nbytes`` over ``degree`` ranks of one host (nothing for no bytes)."""
    if degree <= 1:
        return 0.0 * nbytes
    return allreduce_ms(nbytes, degree, link.ms_per_byte) + 2 * (degree - 1) * link.latency_ms * (nbytes > 0)


def tp_allgather_ms(nbytes: Any, degree: int, link: Link) -> Any:
    """A ring all-gather into ``nbytes`` over ``degree`` ranks of one host (nothing for no bytes)."""
    if degree <= 1:
        return 0.0 * nbytes
    return ring_ms(nbytes, degree, link.ms_per_byte) + (degree - 1) * link.latency_ms * (nbytes > 0)


def _effective(roles: list[LayerRole], degree: int, sequence: bool) -> list[str]:
    """Each layer's role at ``degree``: the vocabulary replicated where the degree does not divide
    it, a ``sequence`` layer replicated unless ``sequence`` ([Note: sequence parallelism])."""
    return [REPLICATED if (r.group == VOCAB_GROUP and r.divides % degree) or (r.role == SEQUENCE and not sequence)
            else r.role for r in roles]


def check_sequence(profile: Profile, sequence: Any, degree: int) -> None:
    """One PartitionError line for ``sequence_parallel`` this degree or profile cannot take."""
    if not isinstance(sequence, bool):
        raise PartitionError(f"sequence_parallel={sequence!r}: need True or False")
    if not sequence:
        return
    if degree < 2 and groups(profile) == {}:
        raise PartitionError("sequence_parallel=True: the model has no tensor-parallel structure, so no TP group "
                             "to split its tokens over; use sequence_parallel=False")
    if degree < 2:
        raise PartitionError("sequence_parallel=True splits by tokens over a TP group: give tensor_parallel >= 2 "
                             "(or 'auto' with devices=N), or sequence_parallel=False")
    roles = _roles(profile)
    if roles is None or not any(r.role == SEQUENCE for r in roles):
        raise PartitionError("sequence_parallel=True: the profile marks no layer 'sequence' (made before autopipe "
                             "looked for them, or a model with none between its groups); re-run `autopipe "
                             "profile ...`, or plan with sequence_parallel=False")


def _sizes(df: Any, base: str) -> list[str]:
    return [c for c in df.columns if c == base or str(c).startswith(f"{base}@")]


def at_degree(profile: Profile, degree: int, link: Link, sequence: bool = False) -> Profile:
    """What one rank of a TP group of ``degree`` runs ([Note: tensor-parallel cost]), its
    ``sequence`` layers split by tokens when ``sequence`` ([Note: sequence parallelism]); the
    profile itself at degree 1. Call :func:`check_degree` (and :func:`check_sequence`) first."""
    if degree == 1:
        return profile
    roles = _roles(profile)
    assert roles is not None
    role = _effective(roles, degree, sequence)
    df = profile.df.copy()
    n = len(df)

    def scale(mask: frozenset[str]) -> Any:
        return np.array([1 / degree if r in mask else 1.0 for r in role])

    scattered = SCATTERED if sequence else frozenset()
    compute, params, saved, output = (scale(m) for m in (SPLITS_COMPUTE, SPLITS_PARAMS, SPLITS_SAVED,
                                                         SPLITS_OUTPUT | scattered))
    if "bwd_working_bytes" in df.columns:
        working = df["bwd_working_bytes"].to_numpy(dtype=np.float64)
        weights = np.minimum(working, df["param_bytes"].to_numpy(dtype=np.float64))
        df["bwd_working_bytes"] = np.rint(weights * params + (working - weights) * output).astype(np.int64)
    for base, factor in [*((c, compute) for c in _TIMES), ("param_bytes", params), ("shared_bytes", params),
                         *((c, saved) for c in _SAVES), *((c, output) for c in _OUTPUTS)]:
        for col in _sizes(df, base):
            values = df[col].to_numpy(dtype=np.float64) * factor
            df[col] = values if base.endswith("_ms") else np.rint(values).astype(np.int64)
    index = {name: i for i, name in enumerate(profile.layers)}
    edges = [(u, v, int(round(b * output[index[u]]))) for u, v, b in profile.edges]
    out_bytes = profile.df["output_bytes"].to_numpy(dtype=np.float64)
    fwd_comm = np.array([out_bytes[i] if role[i] in (ROW, VOCAB_EMBEDDING) else 0.0 for i in range(n)])
    bwd_comm, ratio_of = _backward_comm(profile, role, index, roles)
    gathered = np.array([out_bytes[i] if role[i] == VOCAB_HEAD else 0.0 for i in range(n)])
    for col in _sizes(df, "fwd_ms"):
        rows = _ratio(profile.df, col, "fwd_ms", np.arange(n))
        df[col] = df[col] + tp_allreduce_ms(fwd_comm * rows, degree, link) + tp_allgather_ms(gathered * rows,
                                                                                             degree, link)
    for base in ("bwd_ms", "bwd_input_ms"):
        for col in _sizes(df, base):
            rows = _ratio(profile.df, col.replace(base, "fwd_ms"), "fwd_ms", ratio_of)
            df[col] = df[col] + tp_allreduce_ms(bwd_comm * rows, degree, link)
    meta = {**profile.meta, "tensor_parallel": degree, "sequence_parallel": sequence}
    return profile._derived(df, edges, meta, profile.corrections)  # the loss: over whole logits


def _backward_comm(profile: Profile, role: list[str], index: dict[str, int],
                   roles: list[LayerRole]) -> tuple[Any, Any]:
    """Per layer the bytes its backward all-reduces (a group's input gradient at its first
    column, the head's), and per layer whose output's growth those bytes follow (the row's)."""
    n = len(role)
    comm = np.zeros(n)
    follows = np.arange(n)
    members: dict[str, list[int]] = {}
    for i, r in enumerate(roles):
        if r.group and r.group != VOCAB_GROUP and role[i] != REPLICATED:
            members.setdefault(r.group, []).append(i)
    entering: dict[int, float] = {}  # per layer, the largest value it receives from outside its group
    for u, v, b in profile.edges:
        i, j = index[u], index[v]
        if i not in members.get(roles[j].group, ()):
            entering[j] = max(entering.get(j, 0.0), float(b))
    for idx in members.values():
        columns = [i for i in idx if role[i] == COLUMN]
        rows = [i for i in idx if role[i] == ROW]
        if columns:
            comm[columns[0]] = max(entering.get(i, 0.0) for i in columns)
            follows[columns[0]] = rows[0] if rows else columns[0]
    for i, part in enumerate(role):
        if part == VOCAB_HEAD:
            comm[i] = entering.get(i, 0.0)
    return comm, follows


def _ratio(df: Any, col: str, base: str, follows: Any) -> Any:
    """Per layer, how the bytes of the layer it follows grow from the base size to ``col``'s."""
    if col == base:
        return np.ones(len(follows))
    size = col.split("@", 1)[1]
    new = df[f"output_bytes@{size}"].to_numpy(dtype=np.float64)
    old = df["output_bytes"].to_numpy(dtype=np.float64)
    grown = np.divide(new, old, out=np.ones_like(old), where=old > 0)
    return grown[follows]
