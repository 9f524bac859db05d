"""profile(model, example_inputs) -> Profile: measure every layer of one micro-batch.

    prof = autopipe.profile(model, (x,), chunks=4)       # x: one full batch
    prof.df[["layer", "fwd_ms", "bwd_ms", "saved_bytes"]]
    prof.save("profiles/mymodel.csv")

A pipeline runs micro-batches, so the profiler slices the example batch to one micro-batch
(``ceil(batch / chunks)`` rows) and traces it (autopipe.frontend.tracing.graph). Then, for a model that
fits (``mode="whole"``), it runs the traced graph once to get every node's real value
(autopipe.frontend.profiling.harness.replay) and times each layer alone, forward and backward, on fresh copies of
exactly the values it reads in the real run (autopipe.frontend.profiling.harness.layer_timing). For a model that
does not, or that lives on the meta device (``mode="layers"``), each layer is built alone on the
device with made-up inputs of the traced shapes, and identical layers are measured once
(autopipe.frontend.profiling.harness.layerwise). Both give the same columns; ``measured_as`` names the layer
whose measurement a row holds, and the metadata records the mode and the peak memory.

[Note: progress on a terminal] Long work shows its progress on stderr by default only when
stderr is a terminal, where a person is waiting for it: a bar over the layers here, the ILP's
incumbent, bound and gap in autopipe.solvers.partitioner. A log file, a pipe or a test's captured
stream stays clean. ``progress=True`` forces it, ``progress=False`` silences it. tqdm's
``disable=None`` is exactly this rule, checked against ``sys.stderr`` when the bar is made.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from autopipe.core.device_sheet import DeviceSheet, load_sheet
from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.frontend.profiling._whole_or_layers import choose_mode
from autopipe.frontend.profiling.batches import Measured, keyword_inputs, measure_sizes
from autopipe.frontend.profiling.corrections.in_sequence import (
    SequenceScales,
    measure_sequence,
    scale_rows,
    sequence_budget_s,
)
from autopipe.frontend.profiling.corrections.overheads import stage_call_ms
from autopipe.frontend.profiling.defaults import DEFAULT_REPEATS, DEFAULT_WARMUP
from autopipe.frontend.profiling.estimated.estimate import check_estimate
from autopipe.frontend.profiling.estimated.estimate import estimate as run_estimate
from autopipe.frontend.profiling.harness.backward_split import split_columns, split_ratio
from autopipe.frontend.profiling.harness.inputs import (
    device_name,
    micro_batch,
    model_dtype,
    other_sizes,
    target_device,
    to_device,
)
from autopipe.frontend.profiling.harness.layer_timing import fresh, storage_key, time_runs
from autopipe.frontend.profiling.harness.layerwise import LayerRun, layer_by_layer
from autopipe.frontend.profiling.harness.preserve import preserved
from autopipe.frontend.profiling.harness.process_memory import PeakRss
from autopipe.frontend.profiling.harness.replay import graph_args, layer_calls, record_values
from autopipe.frontend.profiling.harness.timing import Timer, timer_for
from autopipe.frontend.profiling.harness.under_autocast import autocast_call
from autopipe.frontend.profiling.layer_rows import measure_rows
from autopipe.frontend.profiling.steps import check_steps, later_steps, measured_corrections
from autopipe.frontend.tracing.granularity import grouped_meta
from autopipe.frontend.tracing.graph import LayerGraph
from executor.host_allocator import check_host_allocator, host_allocator_in_use, use_host_allocator
from executor.precision import precision_autocast
from executor.spec import check_precision

__all__ = ["profile", "time_model", "DEFAULT_REPEATS", "DEFAULT_WARMUP"]

RSS_INTERVAL_S = 0.005  # how often profile() samples the process's RssAnon (CPU)
_TRACE_KWARGS = ("leaf_modules", "max_depth", "kwargs")


# --- the public entry points -------------------------------------------------------------------
def _check_counts(repeats: int, warmup: int) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be an int >= 1, got {repeats!r}; pass repeats=1 or more")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ProfileError(f"warmup must be an int >= 0, got {warmup!r}; pass warmup=0 or more")


def _shapes(values: Sequence[Any]) -> list[list[int] | None]:
    return [list(map(int, v.shape)) if isinstance(v, torch.Tensor) else None for v in values]


def _check_graph(g: LayerGraph, inputs: tuple[Any, ...], micro: int, chunks: int) -> None:
    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"][: g.num_args]
    traced = _shapes([n.meta.get("val") for n in placeholders])
    wanted = _shapes(list(inputs))
    if traced != wanted:
        raise ProfileError(
            f"graph was traced with input shapes {traced} but one micro-batch ({micro} rows, "
            f"chunks={chunks}) has shapes {wanted}; trace the micro-batch or pass graph=None"
        )


def _state_pointers(model: nn.Module, g: LayerGraph) -> set[int]:
    tensors = [*model.parameters(), *model.buffers(), *g.gm.parameters(), *g.gm.buffers()]
    return {storage_key(t)[0] for t in tensors}


def _home(gm: fx.GraphModule) -> torch.device | None:
    tensor = next(iter([*gm.parameters(), *gm.buffers()]), None)
    return None if tensor is None else tensor.device


def _whole_model_runs(model: nn.Module, g: LayerGraph, args: tuple[Any, ...], precision: str,
                      dev: torch.device) -> Iterator[LayerRun]:
    """Each layer on the values of one real run of the whole model (under ``precision``)."""
    with precision_autocast(precision, dev):
        values = record_values(g.gm, graph_args(g, args))
    state = _state_pointers(model, g)
    for call in layer_calls(g):
        yield LayerRun(call, values, state, signature="")


def _measure_at(
    model: nn.Module,
    inputs: tuple[Any, ...],
    graph: LayerGraph | None,
    chosen: str,
    dev: torch.device,
    timer: Timer,
    repeats: int,
    warmup: int,
    progress: bool | None,
    dedupe: bool,
    tracer: Callable[[tuple[Any, ...]], LayerGraph],
    recompute_call_ms: float = 0.0,
    precision: str = "fp32",
) -> Measured:
    """Trace one micro-batch (unless ``graph``) and measure every layer, whole or layer by layer."""
    if chosen == "whole":
        with preserved(model, dev):
            args = to_device(inputs, dev)
            g = graph if graph is not None else tracer(args)
            home = _home(g.gm)  # a caller's graph goes back where it was
            try:
                g.gm.to(dev)
                rows, extra, edges, splits = measure_rows(g, _whole_model_runs(model, g, args, precision, dev),
                                                      timer, dev, repeats, warmup, progress, precision)
                seq = measure_sequence(g.gm, graph_args(g, args), rows, dev, timer, repeats,  # [Note:
                                       warmup, extra[:2], recompute_call_ms, g.node_layer,  # layers in sequence]
                                       budget_s=sequence_budget_s(repeats), precision=precision)
                ratio = split_ratio(rows, *splits)
                rows, extra = scale_rows(rows, seq), (*extra[:2], seq.recompute_ratio or extra[2])
            finally:
                if home is not None and graph is not None:
                    g.gm.to(home)
        return Measured(g, split_columns(rows, *splits), extra[:2], extra[2], seq, edges, ratio)
    # the model is never moved or run: see [Note: layer by layer]
    with torch.random.fork_rng(devices=[int(dev.index or 0)] if dev.type == "cuda" else []):
        g = graph if graph is not None else tracer(inputs)
        rows, extra, edges, splits = measure_rows(g, layer_by_layer(g, inputs, dev, dedupe=dedupe), timer, dev,
                                              repeats, warmup, progress, precision)
    return Measured(g, split_columns(rows, *splits), extra[:2], extra[2], SequenceScales(), edges,
                    split_ratio(rows, *splits))


def profile(
    model: nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    chunks: int = 1,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    graph: LayerGraph | None = None,
    name: str | None = None,
    progress: bool | None = None,
    timer: Timer | None = None,
    mode: str = "auto",
    dedupe: bool = True,
    memory_budget: int | str | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    host_allocator: str = "system",
    loss_fn: Callable[[Any, Any], Any] | None = None,
    target: Any = None,
    comm: bool = False,
    precision: str = "fp32",
    estimate: str | os.PathLike[str] | DeviceSheet | None = None,
    **trace_kwargs: Any,
) -> Profile:
    """Measure every layer of ``model`` on one micro-batch of ``example_inputs``.

    Args:
        model: the model to profile (left as it was: see [Note: profiling leaves the model
            as it was]).
        example_inputs: one full batch of positional inputs (a tensor or a tuple).
        example_kwargs: one full batch of keyword inputs (an HF batch: ``input_ids=``,
            ``attention_mask=``, ``labels=``), traced and split as ``autopipe.pipeline`` and
            ``distributed_pipeline`` do with theirs, so their ``plan=`` takes the plan made from
            this profile: tensors with a batch dimension are inputs, the rest constants.
        device: "cpu" or "cuda[:N]": where to measure (the whole model is moved there and
            back; layer by layer, only one layer's copy is ever there).
        chunks: micro-batches per batch; one micro-batch is ``ceil(batch / chunks)`` rows.
        repeats: timed runs per layer; the profile holds the median. The whole graph's rounds
            go on past it for a small graph ([Note: layers in sequence]).
        warmup: untimed runs per layer before the timed ones.
        graph: a LayerGraph already traced on one micro-batch (else it is traced here).
        name: the model's name in the metadata (default: its class name).
        progress: a progress bar over the layers on stderr: None (default) shows it when
            stderr is a terminal, True always, False never.
        timer: how to time a call (default: the device's, see autopipe.frontend.profiling.harness.timing).
        mode: ``"whole"`` (one real run of the model on the device), ``"layers"`` (each layer
            alone, for models that do not fit or live on the meta device) or ``"auto"``: see
            [Note: whole or layer by layer].
        dedupe: layer by layer, measure identical layers once ([Note: identical layers]);
            the ``measured_as`` column names the layer whose measurement a row reuses.
        memory_budget: bytes (or "16GiB") the model's tensors may take on the device before
            ``auto`` goes layer by layer (default on CUDA: its free memory).
        micro_batch_sizes: more micro-batch sizes (rows) to measure, besides the one
            ``chunks`` makes: their times and bytes go into columns ``fwd_ms@R`` ... and
            ``meta["micro_batch_sizes"]``, from which ``partition(chunks="auto")``
            interpolates ([Note: micro-batch scaling]). Rows beyond the example batch repeat it.
        host_allocator: ``"system"`` (default: the process's allocator as it is) or
            ``"retain"`` (on a CPU, glibc keeps freed memory for reuse, as the command line
            does); the setting the process ran under is recorded as ``meta["host_allocator"]``
            ([Note: freed memory stays in the process] in executor/host_allocator.py).
        loss_fn, target: the training loss ``loss_fn(output, target)`` and the batch's target:
            timed on one micro-batch into ``corrections.loss`` ([Note: the loss in the last stage]).
        comm: also measure two ranks on this host (10-20 s): the transfer, the distributed
            runtime's call costs, the ranks' slowdown ([Note: measured transfer]).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: what the pipeline will compute in; every
            forward is measured under its autocast, so times and bytes are the precision's, and
            ``meta["precision"]`` records it ([Note: profiling under a precision]).
        estimate: a device sheet (a shipped sheet's name, ``"h100"``, a sheet file's path or a
            DeviceSheet) to ESTIMATE every layer on instead of measuring it: counted FLOPs and
            bytes on fake tensors, no weights allocated, nothing timed ([Note: counted, not
            timed] in estimated/op_counts.py); ``meta["estimated"]`` records the sheet ([Note:
            estimated or measured]). ``device``, ``mode``, ``timer`` and ``comm`` then do not apply,
            and ``repeats`` / ``warmup`` are not needed (a count is the same every time). The
            model is traced with ``repeated=True`` ([Note: repeated blocks]).
        **trace_kwargs: ``leaf_modules``, ``max_depth``, ``kwargs`` for :func:`autopipe.trace`.
        The steps run in one order: [Note: one list of measurement steps] in steps.py.

    Raises:
        ProfileError: bad arguments, a device that is not there, batch < chunks, or a
            ``graph`` traced at other input shapes.
    """
    unknown = sorted(set(trace_kwargs) - set(_TRACE_KWARGS))
    if unknown:
        raise ProfileError(f"unknown argument(s) {unknown}; profile() passes only {list(_TRACE_KWARGS)} to trace()")
    if not isinstance(model, nn.Module):
        raise ProfileError(f"profile() needs an nn.Module, got {type(model).__name__}")
    _check_counts(repeats, warmup)
    check_steps(loss_fn, target, comm)
    try:
        check_precision(precision)
    except ValueError as err:
        raise ProfileError(str(err)) from None
    if progress is not None and not isinstance(progress, bool):
        raise ProfileError(f"progress must be True, False or None (a bar when stderr is a "
                           f"terminal), got {progress!r}")
    traced_as = {**trace_kwargs, "repeated": True} if estimate is not None else trace_kwargs  # [Note: repeated blocks]
    whole, example_inputs, tracer = keyword_inputs(model, example_inputs, example_kwargs, traced_as)
    inputs, batch, micro = micro_batch(example_inputs, chunks)
    if graph is not None:
        _check_graph(graph, inputs, micro, chunks)
    if estimate is not None:  # [Note: counted, not timed]
        sheet = load_sheet(estimate)
        check_estimate(device, mode, comm, timer)
        return run_estimate(model, example_inputs, inputs, sheet=sheet, graph=graph, tracer=tracer, batch=batch,
                            micro=micro, chunks=chunks, others=other_sizes(micro_batch_sizes, micro), name=name,
                            precision=precision, progress=progress, dedupe=dedupe, loss_fn=loss_fn, target=target)
    dev = target_device(device)
    check_host_allocator(host_allocator)
    if dev.type == "cpu":
        use_host_allocator(host_allocator)  # [Note: freed memory stays in the process]
    chosen = choose_mode(mode, model, dev, memory_budget)
    timer = timer or timer_for(dev)
    others = other_sizes(micro_batch_sizes, micro)
    calls = stage_call_ms(timer, dev, chunks, precision)  # [Note: measured overheads]

    def measure_at(args: tuple[Any, ...], given: LayerGraph | None) -> Measured:
        return _measure_at(model, args, given, chosen, dev, timer, repeats, warmup, progress,
                           dedupe, tracer, calls[2], precision)

    # RssAnon sampled every 5 ms: at 1 ms the sampler's wake-ups (a read of /proc and the GIL
    # each) cost ~7% of a busy loop's CPU and interrupt what is being timed; on CUDA the peak is
    # the allocator's and nothing is sampled
    rss = PeakRss(RSS_INTERVAL_S) if dev.type == "cpu" else None
    with rss or contextlib.nullcontext():
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        measured, frame, fingerprints = measure_sizes(measure_at, inputs, graph, example_inputs, micro, others)
        g = measured.graph
    peak = (int(torch.cuda.max_memory_allocated(dev)), "cuda max_memory_allocated") \
        if dev.type == "cuda" else (rss.bytes if rss is not None else None, "RssAnon of the process")
    meta = {
        "model": name or type(model).__name__,
        "device": device_name(dev),
        "device_type": dev.type,
        "dtype": model_dtype(model),
        "precision": precision,
        "batch_size": batch,
        "chunks": chunks,
        "micro_batch_size": micro,
        "repeats": repeats,
        "warmup": warmup,
        "cpu_threads": torch.get_num_threads(),
        "host_allocator": host_allocator_in_use(),
        "torch_version": torch.__version__,
        "fingerprint": g.fingerprint,
        "source": g.source,
        "mode": chosen,
        "dedupe": bool(dedupe) if chosen == "layers" else False,
        "measured_layers": sum(1 for r in measured.rows if r["measured_as"] == r["layer"]),
        **({"grouped": grouped_meta(g.layers, g.grouped)} if g.grouped else {}),  # [Note: automatic granularity]
        **({"bwd_split_ratio": measured.split_ratio} if measured.split_ratio is not None else {}),  # [Note: split backward measured]
        "peak_memory_bytes": peak[0],
        "peak_memory_of": peak[1],
        **({"micro_batch_sizes": sorted([micro, *others]), "fingerprints": fingerprints}
           if others else {}),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    corrections = measured_corrections(measured.harness_ms, calls, measured.recompute_ratio,
                                       measured.scales, chosen == "whole")
    return later_steps(Profile(frame, measured.edges, meta, corrections), whole, example_inputs, device=dev,
                       loss_fn=loss_fn, target=target, comm=comm)


def time_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    device: str | torch.device = "cpu",
    chunks: int = 1,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    kwargs: dict[str, Any] | None = None,
    timer: Timer | None = None,
    precision: str = "fp32",
) -> tuple[float, float]:
    """Median forward and backward ms of the WHOLE model on one micro-batch (its forward under
    ``precision``'s autocast, as :func:`profile` measures).

    The peer measurement for a profile: the sum of a profile's per-layer times should be
    close to this (benchmarks/profile_accuracy.py reports the ratio).
    """
    _check_counts(repeats, warmup)
    inputs, _, _ = micro_batch(example_inputs, chunks)
    dev = target_device(device)
    with preserved(model, dev):
        args, timer = to_device(inputs, dev), timer or timer_for(dev)
        forward = autocast_call(model, check_precision(precision), dev)
        return time_runs(
            timer, lambda: functools.partial(forward, *fresh(args), **(kwargs or {})), repeats, warmup
        )
