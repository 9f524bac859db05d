"""``profile(..., estimate=SHEET)``: a Profile counted on fake tensors and priced on a device sheet.

    prof = autopipe.profile(model, (x,), chunks=8, estimate="h100")   # nothing measured
    prof.meta["estimated"]["name"]                                     # "h100"

The model is traced as for a measured profile (a model built on the meta device needs no
memory for its weights), a stack of identical blocks on two and three of them and the rest
repeated where that gives the same graph ([Note: repeated blocks] in tracing/repeated.py),
then every layer is built alone on fake tensors, identical layers once
([Note: layer by layer], [Note: identical layers]), and goes through the same harness as a
measured layer with a counting timer ([Note: counted, not timed] in op_counts.py): each
forward and backward is the device sheet's roofline summed over its ops, its saved bytes are
what autograd saves on the fake tensors (to the byte, under the precision's autocast), its
backward splits into the zero-bubble schedules' two halves as torch splits it. So the rows have
every column a measured profile has, and partition, simulate, explain and plot read it
unchanged. What is not a layer:

- the loss (``loss_fn``, ``target``): counted on a fake output of the graph's shape;
- the stage call's fixed host cost and the checkpoint's: none (not measured, not counted);
- the transfer between stages: the sheet's inter-host bandwidth, no latency, no receive share
  (a plan may pass ``bandwidth=`` for stages on one host, ``sheet.intra_host_bandwidth``).

Autocast is the CPU's (the fake tensors are CPU tensors): the ops it casts to bf16 / fp16 are
CUDA's but for a few (CUDA also runs softmax, layer_norm and the losses in fp32).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autopipe.core.corrections import Corrections, LossCost, Phases, Transfer
from autopipe.core.device_sheet import DeviceSheet
from autopipe.core.estimated import ESTIMATED
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.batches import Measured, measure_sizes
from autopipe.frontend.profiling.corrections.in_sequence import SequenceScales
from autopipe.frontend.profiling.corrections.loss_timing import loss_bytes, loss_ms
from autopipe.frontend.profiling.estimated.op_counts import CountingTimer
from autopipe.frontend.profiling.harness.backward_split import split_columns, split_ratio
from autopipe.frontend.profiling.harness.inputs import micro_batch, model_dtype
from autopipe.frontend.profiling.harness.layerwise import LayerRun, layer_by_layer
from autopipe.frontend.profiling.harness.under_autocast import autocast_call
from autopipe.frontend.profiling.layer_rows import measure_rows
from autopipe.frontend.tracing.granularity import grouped_meta
from autopipe.frontend.tracing.graph import LayerGraph
from executor._torch_compat import FakeTensorMode, tree_leaves

__all__ = ["check_estimate", "estimate"]

_CPU = torch.device("cpu")  # the fake tensors' device; what runs is counted, never run


def check_estimate(device: Any, mode: str, comm: bool, timer: Any) -> None:
    """One line for what ``estimate=`` cannot take: nothing is measured, so neither a device to
    measure on, nor a whole run, nor a link measured between ranks, nor a timer."""
    if str(device) != "cpu":
        raise ProfileError(f"estimate= counts on fake tensors and measures nothing, so device={str(device)!r} "
                           "has no use; drop device= (the sheet names the device estimated)")
    if mode not in ("auto", "layers"):
        raise ProfileError(f"estimate= estimates each layer alone; mode={mode!r} cannot run: drop mode=")
    if comm:
        raise ProfileError("estimate= with comm=True would put this host's measured link into an estimated "
                           "profile; the transfer comes from the sheet's inter_host_bandwidth")
    if timer is not None:
        raise ProfileError("estimate= counts instead of timing; drop timer=")


def _estimate_at(args: tuple[Any, ...], given: LayerGraph | None, tracer: Callable[[tuple[Any, ...]], LayerGraph],
                 sheet: DeviceSheet, precision: str, progress: bool | None, dedupe: bool) -> Measured:
    """One micro-batch size: traced (unless ``given``), each layer counted on fake tensors."""
    with torch.random.fork_rng(devices=[]):
        g = given if given is not None else tracer(args)
        rows, extra, edges, splits = measure_rows(g, _fake_layers(g, args, dedupe), CountingTimer(sheet), _CPU,
                                                  1, 0, progress, precision)
    return Measured(g, split_columns(rows, *splits), extra[:2], extra[2], SequenceScales(), edges,
                    split_ratio(rows, *splits))


def _fake_layers(g: LayerGraph, args: tuple[Any, ...], dedupe: bool) -> Iterator[LayerRun]:
    """Each layer alone ([Note: layer by layer]), its parameters and inputs fake tensors: made
    under a FakeTensorMode, they stay fake wherever they are used (what the harness makes of
    its own, outside the mode, is real and a few elements)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    runs = layer_by_layer(g, args, _CPU, dedupe=dedupe)
    while True:
        with mode:
            run = next(runs, None)
        if run is None:
            return
        yield run


def _loss(g: LayerGraph, loss_fn: Callable[[Any, Any], Any], target: Any, chunks: int, sheet: DeviceSheet,
          precision: str) -> LossCost:
    """The loss counted on a fake output of the graph's (one micro-batch's) shape."""
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    values = [n.meta.get("val") for n in tree_leaves(out.args) if isinstance(n, torch.fx.Node)]
    if len(values) != 1 or not isinstance(values[0], torch.Tensor):
        raise ProfileError(f"estimate= counts loss_fn on the model's output, but the model returns {len(values)} "
                           "values; pass loss_fn=None (a model that returns its own loss counts it in its layers)")
    try:
        targets, _, micro = micro_batch(target, chunks)
    except ProfileError as err:
        raise ProfileError(f"target: {err}") from None
    shape, dtype = tuple(values[0].shape), values[0].dtype
    with FakeTensorMode(allow_non_fake_inputs=True):
        output = torch.empty(shape, dtype=dtype)
        value = targets if isinstance(target, tuple) else targets[0]
        call = autocast_call(loss_fn, precision, _CPU)
        fwd, bwd = loss_ms(output, value, call, CountingTimer(sheet), repeats=1, warmup=0)
        held, peak = loss_bytes(output, value, call)
    return LossCost(round(fwd, 6), round(bwd, 6), micro, held, peak)


def estimate(model: nn.Module, example_inputs: Any, inputs: tuple[Any, ...], *, sheet: DeviceSheet,
             graph: LayerGraph | None, tracer: Callable[[tuple[Any, ...]], LayerGraph], batch: int,
             micro: int, chunks: int, others: Sequence[int], name: str | None, precision: str,
             progress: bool | None, dedupe: bool, loss_fn: Callable[[Any, Any], Any] | None,
             target: Any) -> Profile:
    """The estimated Profile of one micro-batch ``inputs`` of ``example_inputs`` (and of
    ``others`` rows), every layer on ``sheet`` ([Note: estimated or measured])."""
    def measure_at(args: tuple[Any, ...], given: LayerGraph | None) -> Measured:
        return _estimate_at(args, given, tracer, sheet, precision, progress, dedupe)

    measured, frame, fingerprints = measure_sizes(measure_at, inputs, graph, example_inputs, micro, others)
    g = measured.graph
    frame[ESTIMATED] = sheet.name
    loss = None if loss_fn is None else _loss(g, loss_fn, target, chunks, sheet, precision)
    numbers = {k: v for k, v in sheet.to_json().items() if k not in ("format", "sources")}
    meta = {
        "model": name or type(model).__name__,
        "device": sheet.device,
        "device_type": sheet.device_type,
        "dtype": model_dtype(model),
        "precision": precision,
        "batch_size": batch,
        "chunks": chunks,
        "micro_batch_size": micro,
        "repeats": 1,
        "warmup": 0,
        "torch_version": torch.__version__,
        "fingerprint": g.fingerprint,
        "source": g.source,
        "mode": "layers",
        "dedupe": bool(dedupe),
        "measured_layers": sum(1 for r in measured.rows if r["measured_as"] == r["layer"]),
        ESTIMATED: numbers,
        **({"grouped": grouped_meta(g.layers, g.grouped)} if g.grouped else {}),
        **({"bwd_split_ratio": measured.split_ratio} if measured.split_ratio is not None else {}),
        "peak_memory_bytes": None,
        "peak_memory_of": "nothing: estimated",
        **({"micro_batch_sizes": sorted([micro, *others]), "fingerprints": fingerprints} if others else {}),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    corrections = Corrections(
        harness=Phases(round(measured.harness_ms[0], 6), round(measured.harness_ms[1], 6)),
        recompute_ratio=round(measured.recompute_ratio, 4), loss=loss,
        transfer=Transfer(0.0, sheet.inter_host_bandwidth, 0.0))
    return Profile(frame, measured.edges, meta, corrections)

