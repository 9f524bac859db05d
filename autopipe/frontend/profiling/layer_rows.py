"""Every layer of a graph measured into its profile row: one mechanism of ``profile()``.

For each layer (a whole run's or one built alone: [Note: layer by layer] in layerwise.py) in
layer order: its saved bytes and peak (``layer_timing.probe``), its median forward and backward
with the harness's overhead subtracted ([Note: harness overhead] in layer_timing.py), its
backward in torch's two halves ([Note: split backward measured] in backward_split.py) and its
share of the recompute-ratio sample (overheads.py); a layer identical to an earlier one takes
that one's measurements ([Note: identical layers]); then the bytes each layer's producers
already save ([Note: saved once]) and, under a precision, the edges' bytes re-measured ([Note:
profiling under a precision] in under_autocast.py).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

import torch
from tqdm import tqdm

from autopipe.frontend.profiling.corrections.overheads import RecomputeSampler
from autopipe.frontend.profiling.harness.backward_split import (
    BackwardSplit,
    Overhead,
    measure_split,
    split_overhead,
)
from autopipe.frontend.profiling.harness.layer_timing import (
    harness_overhead,
    probe,
    shared_saved,
    time_layer,
)
from autopipe.frontend.profiling.harness.layerwise import LayerRun
from autopipe.frontend.profiling.harness.timing import Timer, memory_meter_for
from autopipe.frontend.profiling.harness.under_autocast import layer_output_bytes, measured_edges
from autopipe.frontend.tracing.graph import LayerGraph

__all__ = ["Edges", "Splits", "measure_rows"]

Edges = list[tuple[str, str, int]]
Splits = tuple[dict[str, BackwardSplit], Overhead]  # each measured layer's, and the halves' overhead


def measure_rows(
    g: LayerGraph,
    runs: Iterable[LayerRun],
    timer: Timer,
    dev: torch.device,
    repeats: int,
    warmup: int,
    progress: bool | None,
    precision: str,
) -> tuple[list[dict[str, Any]], tuple[float, float, float], Edges, Splits]:
    """Every layer's row, the harness overhead subtracted, the recompute ratio (overheads.py),
    the edges (their bytes re-measured under a precision: [Note: profiling under a precision]),
    each measured layer's split backward ([Note: split backward measured])."""
    meter = memory_meter_for(dev)
    fwd_extra, bwd_extra = harness_overhead(timer, dev, precision) if timer.harness_cost else (0.0, 0.0)
    sampler = RecomputeSampler(timer, repeats, warmup)
    rows: list[dict[str, Any]] = []
    measured: dict[str, tuple[float, float, int, int | None, int]] = {}
    splits: dict[str, BackwardSplit] = {}
    split_extra = split_overhead(timer, dev, precision) if timer.harness_cost else (0.0, 0.0)
    ends: dict[str, tuple[int, int, int]] = {}  # saved bytes of: inputs, graph inputs, outputs
    kept: dict[str, int] = {}  # saved bytes of its inputs from other layers, not written in place
    outs: dict[str, list[int]] = {}  # under a precision: each layer's output bytes, measured
    node_bytes: dict[str, int] = {}
    graph_inputs = {n.name for n in g.gm.graph.nodes if n.op == "placeholder"}
    # [Note: progress on a terminal]: tqdm's disable=None is "off unless the file is a TTY"
    bar = tqdm(runs, total=len(g.layers), desc="profiling", unit="layer", file=sys.stderr,
               disable=None if progress is None else not progress, leave=False)
    for run in bar:
        run = dataclasses.replace(run, call=dataclasses.replace(run.call, precision=precision, device=dev))
        if run.reuse_of is None:
            if precision != "fp32":
                outs[run.call.name] = layer_output_bytes(run.call, run.values)
            saved, saved_in, saved_out, written, peak, working = probe(run.call, run.values, meter, run.state)
            ends[run.call.name] = (sum(saved_in), sum(b for b, name in zip(
                saved_in, run.call.inputs, strict=True) if name in graph_inputs), saved_out)
            # a stage it starts writes a copy of its input: not the input the stage keeps
            # ([Note: a stage writes a copy of its input] in frontend/building/stages.py)
            kept[run.call.name] = ends[run.call.name][0] - ends[run.call.name][1] - written
            fwd_ms, bwd_ms = time_layer(run.call, run.values, timer, repeats, warmup)
            fwd_ms = max(0.0, fwd_ms - fwd_extra)
            bwd_ms = max(0.0, bwd_ms - bwd_extra) if bwd_ms > 0 else 0.0
            measured[run.call.name] = (fwd_ms, bwd_ms, saved, peak, working)
            if (split := measure_split(run.call, run.values, timer)) is not None:
                splits[run.call.name] = split
            sampler.offer(run.call, run.values, fwd_ms, bwd_ms)
        source = run.reuse_of or run.call.name
        rows.append(_row(g, run.call.name, *measured[source], measured_as=source))
        ends[run.call.name] = ends[source]
        kept[run.call.name] = kept[source]
        if precision != "fp32":  # a reused layer's outputs are its source's, in order
            node_bytes.update(zip(run.call.outputs, outs[source], strict=True))
    shared = shared_saved(g.edges(), ends)
    edges, out_bytes = measured_edges(g, node_bytes) if precision != "fp32" else (g.edges(), {})
    return [{**r, "saved_shared_bytes": shared[r["layer"]],
             "saved_input_bytes": max(kept[r["layer"]], 0),
             "output_bytes": out_bytes.get(r["layer"], r["output_bytes"]),
             "returned_bytes": _measured_share(r["returned_bytes"], r["output_bytes"], out_bytes.get(r["layer"]))}
            for r in rows], \
        (fwd_extra, bwd_extra, sampler.ratio()), edges, (splits, split_extra)


def _measured_share(returned: int, traced: int, measured: int | None) -> int:
    """What a layer returns, in its measured output's precision: the traced share of it."""
    return returned if measured is None or not traced else round(returned * measured / traced)


def _row(g: LayerGraph, layer: str, fwd_ms: float, bwd_ms: float, saved: int, peak: int | None,
         working: int, measured_as: str) -> dict[str, Any]:
    a = g.nx.nodes[layer]
    return {
        "layer": layer,
        "fwd_ms": round(fwd_ms, 6),
        "bwd_ms": round(bwd_ms, 6),
        "param_bytes": int(a["param_bytes"]),
        "output_bytes": int(a["output_bytes"]),
        "returned_bytes": int(a.get("returned_bytes", 0)),
        "saved_bytes": saved,
        "peak_bytes": float("nan") if peak is None else float(peak),
        "bwd_working_bytes": working,
        "buffer_bytes": int(a["buffer_bytes"]),
        "shared_bytes": int(a["shared_bytes"]),
        "tie_group": str(a["tie_group"]),
        "kind": str(a["kind"]),
        "module_type": str(a["module_type"]),
        "measured_as": measured_as,
        "tp_role": str(a.get("tp_role", "")),
        "tp_group": str(a.get("tp_group", "")),
        "tp_divides": int(a.get("tp_divides", 0)),
    }


