"""The ``autopipe profile`` command as one library call, and a profile's summary table.

    prof, path = profile_to_file("mlp", batch_size=32, chunks=4, out="profiles/mlp.csv")
    print(summary_table(prof))
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopipe.app.config import DEFAULT_CHUNKS, resolve
from autopipe.app.model_spec import load_model
from autopipe.core.device_sheet import load_sheet
from autopipe.core.estimated import estimate_text
from autopipe.core.profile_table import Profile
from autopipe.core.tensor_parallel import structure_text
from autopipe.core.units import format_bytes
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.profiler import DEFAULT_REPEATS, DEFAULT_WARMUP, profile
from autopipe.frontend.profiling.spawned.comm import load_comm, with_comm


def _loss_of(loaded: Any) -> dict[str, Any]:
    """profile()'s ``loss_fn`` and ``target`` where the model comes with both ([Note: the loss
    in the last stage]); none where it does not."""
    if loaded.loss_fn is None or loaded.target is None:
        return {}
    return {"loss_fn": loaded.loss_fn, "target": loaded.target}

__all__ = ["profile_to_file", "summary_table", "parse_shape"]


def summary_table(prof: Profile, top: int = 10, where: str | os.PathLike[str] | None = None) -> str:
    """The ``top`` heaviest layers (forward + backward time), the totals and how it was measured;
    every layer when there are at most ``top``. ``where``: the saved file holding every row."""
    df = prof.df.assign(_ms=prof.df["fwd_ms"] + prof.df["bwd_ms"])
    total_ms = float(df["_ms"].sum()) or 1.0
    shown = df if len(df) <= top else df.nlargest(top, "_ms", keep="first")
    width = max(len("layer"), *(len(str(x)) for x in shown["layer"]))
    head = (f"{'layer':<{width}} {'type':<18} {'fwd ms':>8} {'bwd ms':>8} {'share':>6} {'params':>10} "
            f"{'output':>10} {'saved':>10}")
    lines = []
    if len(shown) < len(df):
        lines.append(f"the {len(shown)} heaviest of {len(df)} layers (forward + backward), heaviest first"
                     + (f"; every layer is in {where}" if where is not None else ""))
    lines += [head, "-" * len(head)]
    for r in shown.to_dict("records"):
        lines.append(
            f"{str(r['layer']):<{width}} {str(r['module_type'])[:18]:<18} "
            f"{r['fwd_ms']:>8.3f} {r['bwd_ms']:>8.3f} {100 * r['_ms'] / total_ms:>5.1f}% "
            f"{format_bytes(r['param_bytes']):>10} {format_bytes(r['output_bytes']):>10} "
            f"{format_bytes(r['saved_bytes']):>10}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"{f'total ({len(df)} layers)':<{width + 19}} {df['fwd_ms'].sum():>8.3f} "
        f"{df['bwd_ms'].sum():>8.3f} {'100.0%':>6} {format_bytes(float(df['param_bytes'].sum())):>10} "
        f"{'':>10} {format_bytes(float(df['saved_bytes'].sum())):>10}"
    )
    m = prof.meta
    how = ("counted once" if estimate_text(m) is not None else
           f"median of {m.get('repeats')} repeats, {m.get('cpu_threads')} CPU thread(s)")
    lines.append(
        f"device {m.get('device')}, micro-batch {m.get('micro_batch_size')} "
        f"(batch {m.get('batch_size')} / chunks {m.get('chunks')}), {m.get('dtype')}, "
        f"{how}, fingerprint {m.get('fingerprint')}"
    )
    grouped = m.get("grouped")
    if grouped:  # [Note: automatic granularity] in autopipe/frontend/tracing/granularity.py
        merged = grouped["merged"]
        lines.append(f"{grouped['traced_layers']} traced layers grouped into {len(df)}: "
                     + ", ".join(f"{name} ({n})" for name, n in list(merged.items())[:4])
                     + (f" and {len(merged) - 4} more" if len(merged) > 4 else "")
                     + " are one layer each; trace with leaf_modules= or max_depth= to choose")
    lines.append(structure_text(prof))  # [Note: tensor-parallel structure]
    c = prof.corrections
    ranks = c.stage_calls.get("distributed", {})
    estimated = estimate_text(m)
    if c.transfer is not None and estimated is not None:
        lines.append(f"between stages: {format_bytes(c.transfer.bandwidth)}/s, the sheet's inter-host link "
                     "(partition --bandwidth BYTES_PER_S for stages on one host)")
    elif c.transfer is not None:
        t, call = c.transfer, c.call_for("distributed", "gpipe")
        on = " on 2 nodes" if m.get("comm_nodes") == 2 else ""
        lines.append(f"between two ranks{on} ({m.get('comm_backend')}): {t.latency_ms} ms + bytes / "
                     f"{'no measurable bandwidth' if math.isinf(t.bandwidth) else format_bytes(t.bandwidth) + '/s'}"
                     f", the receiver {t.receive_share} x the bytes' time again; "
                     f"{call.fwd_ms} + {call.bwd_ms} ms per stage call"
                     + "".join(f" ({ranks[s].fwd_ms} + {ranks[s].bwd_ms} under {s})"
                               for s in ("1f1b", "interleaved1f1b") if s in ranks))
    if c.rank_compute_slowdown is not None:
        lines.append(f"ranks on this host compute {c.rank_compute_slowdown}x slower beside each other "
                     "(the model with a copy of itself running beside it); plans for `autopipe run` "
                     "from this profile predict ranks")
    if c.loss is not None:
        lines.append(f"the loss: {c.loss.fwd_ms} + {c.loss.bwd_ms} ms per micro-batch, paid by the last stage")
    if estimated is not None:  # [Note: estimated or measured]
        lines.append(f"ESTIMATED on device sheet {estimated}, not measured: {m.get('measured_layers')} of "
                     f"{len(df)} layers counted (the others are identical to one of them, column measured_as)")
    elif m.get("mode") == "layers":
        peak = m.get("peak_memory_bytes")
        lines.append(
            f"profiled layer by layer: {m.get('measured_layers')} of {len(df)} layers measured, "
            f"the others are identical to one of them (column measured_as); peak memory "
            f"{format_bytes(peak) if peak is not None else 'not measured'} ({m.get('peak_memory_of')})"
        )
    return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` -> ``(3, 32, 32)``: one sample's shape, without the batch dimension."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ProfileError(
            f"--input-shape {text!r} is not a shape; give one sample's sizes without the batch "
            "dimension, e.g. 3,32,32"
        )
    return shape


def _leaf_modules(model: nn.Module, names: Sequence[str]) -> list[type[nn.Module] | str]:
    """Each --leaf: a submodule's qualified name, or the class name of submodules."""
    qualified = {name for name, _ in model.named_modules() if name}
    classes = {type(m).__name__: type(m) for m in model.modules()}
    out: list[type[nn.Module] | str] = []
    for name in names:
        if name in qualified:
            out.append(name)
        elif name in classes:
            out.append(classes[name])
        else:
            example = next(iter(sorted(qualified)), "")
            raise ProfileError(
                f"--leaf {name!r} names neither a submodule nor a module class of "
                f"{type(model).__name__}; use a qualified name such as {example!r} or a class name"
            )
    return out


def _csv_json(out: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = Path(out)
    base = p.with_suffix("") if p.suffix in (".csv", ".json") else p
    return base.with_name(base.name + ".csv"), base.with_name(base.name + ".json")


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(r < 1 for r in sizes):
        raise ProfileError(f"--micro-batch-sizes {text!r}: give row counts >= 1 separated by "
                           "commas, e.g. 1,2,4,8")
    return sizes


def profile_to_file(
    model: str,
    *,
    out: str | os.PathLike[str] | None = None,
    force: bool = False,
    batch_size: int | None = None,
    chunks: int | None = None,
    device: str = "cpu",
    repeats: int | None = None,
    warmup: int | None = None,
    max_depth: int | None = None,
    leaf: Sequence[str] | None = None,
    input_shape: str | None = None,
    threads: int | None = None,
    progress: bool = True,
    mode: str = "auto",
    meta: bool = False,
    micro_batch_sizes: str | None = None,
    comm: bool = False,
    comm_from: str | os.PathLike[str] | None = None,
    host_allocator: str = "retain",
    precision: str = "fp32",
    estimate: str | None = None,
) -> tuple[Profile, Path]:
    """Profile the model named ``model`` (see autopipe.app.model_spec) and save it.

    ``out`` defaults to ``profiles/NAME.csv``; existing files are never touched unless
    ``force``. ``threads`` sets torch's CPU threads while measuring (recorded in the metadata).
    ``chunks`` defaults to DEFAULT_CHUNKS ([Note: one chunks rule] in autopipe/app/config.py).
    ``meta`` builds the model on the meta device ([Note: models built on meta] in
    autopipe/app/model_spec.py); ``mode`` is profile()'s. ``comm`` adds the transfer between
    two ranks and the distributed runtime's call cost ([Note: measured transfer]); ``comm_from``
    takes them from a file of ``autopipe comm`` instead (the link between two hosts).
    ``host_allocator`` and ``precision`` are profile()'s, "retain" as the command line trains.
    ``estimate``: a device sheet to estimate the layers on instead of measuring them (the model
    built on the meta device; [Note: counted, not timed]).
    """
    if threads is not None and threads < 1:
        raise ProfileError(f"--threads must be >= 1, got {threads}; pass --threads 1 for reproducible CPU timings")
    if comm and comm_from is not None:
        raise ProfileError(f"--comm and --comm-from {comm_from}: pass one; --comm measures two ranks on this "
                           "host, --comm-from takes the link `autopipe comm` measured")
    if estimate is not None and comm_from is not None:
        raise ProfileError(f"--estimate {estimate} and --comm-from {comm_from}: an estimated profile takes its "
                           "link from the sheet; drop --comm-from")
    if estimate is not None:
        load_sheet(estimate)  # a bad sheet: before building the model
    measured = load_comm(comm_from) if comm_from is not None else None  # a bad file: before measuring
    shape = parse_shape(input_shape) if input_shape is not None else None
    sizes = _parse_sizes(micro_batch_sizes) if micro_batch_sizes is not None else None
    loaded = load_model(model, batch_size, input_shape=shape, meta=meta or estimate is not None)
    csv_path, json_path = _csv_json(out if out is not None else Path("profiles") / f"{loaded.name}.csv")
    existing = [str(p) for p in (csv_path, json_path) if p.exists()]
    if existing and not force:  # fail before measuring, and leave the files untouched
        raise ProfileError(
            f"{' and '.join(existing)} already exist(s): refusing to overwrite a saved profile; "
            "pass --force or choose another --out"
        )
    kwargs: dict[str, Any] = {}
    if max_depth is not None:
        kwargs["max_depth"] = max_depth
    if leaf:
        kwargs["leaf_modules"] = _leaf_modules(loaded.model, leaf)
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        prof = profile(
            loaded.model, loaded.inputs, example_kwargs=loaded.kwargs, device=device,
            chunks=resolve(chunks, default=DEFAULT_CHUNKS),
            repeats=DEFAULT_REPEATS if repeats is None else repeats,
            warmup=DEFAULT_WARMUP if warmup is None else warmup,
            name=loaded.name, progress=progress, mode=mode, micro_batch_sizes=sizes,
            host_allocator=host_allocator, comm=comm, precision=precision, estimate=estimate,
            **_loss_of(loaded), **kwargs,
        )
    finally:
        torch.set_num_threads(before)
    if measured is not None:
        prof = with_comm(prof, measured=measured)
    return prof, prof.save(csv_path, overwrite=force)
