"""profile(model, example_inputs) -> Profile: measure every layer of one micro-batch.

    prof = autopipe.profile(model, (x,), chunks=4)       # x: one full batch
    prof.df[["layer", "fwd_ms", "bwd_ms", "saved_bytes"]]
    prof.save("profiles/mymodel.csv")

A pipeline runs micro-batches, so the profiler slices the example batch to one micro-batch
(``ceil(batch / chunks)`` rows), traces it (autopipe.frontend.graph), runs the traced graph once to get
every node's real value (autopipe.frontend.replay), and then times each layer alone, forward and
backward, on fresh copies of exactly the values it reads in the real run.

[Note: in-place layers] A layer's inputs are recorded once and cloned before every repeat, and
an input that needs a gradient is passed as a non-leaf clone of a fresh leaf. So a layer that
writes its input in place (``ReLU(inplace=True)``) neither corrupts the recorded values of later
repeats nor trips autograd's "leaf variable used in an in-place operation" check; torchgpipe's
profiler breaks on exactly that.

[Note: harness overhead] Timing a layer alone adds costs the real pipeline does not pay: the
call of the layer's GraphModule, and above all one ``torch.autograd.backward`` call per layer
(engine start-up, the input's clone and gradient accumulation), about 20 us on a CPU. For a
small layer that is more than its work. The profiler times an EMPTY layer (inputs -> outputs,
no op) through the very same code path and subtracts its median from every layer's (clamped at
zero); the amounts are recorded in the metadata as ``harness_fwd_ms`` / ``harness_bwd_ms``.
benchmarks/profile_accuracy.py checks the result: the sum over layers against a whole-model
forward + backward of the same micro-batch.

[Note: progress on a terminal] Long work shows its progress on stderr by default only when
stderr is a terminal, where a person is waiting for it: a bar over the layers here, the ILP's
incumbent, bound and gap in autopipe.solvers.partitioner. A log file, a pipe or a test's captured
stream stays clean. ``progress=True`` forces it, ``progress=False`` silences it. tqdm's
``disable=None`` is exactly this rule, checked against ``sys.stderr`` when the bar is made.
"""

from __future__ import annotations

import datetime
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
from torch import fx, nn
from tqdm import tqdm

from autopipe.core.profile_table import Profile
from autopipe.errors import ProfileError
from autopipe.frontend.graph import LayerGraph, trace
from autopipe.frontend.inputs import micro_batch, target_device, to_device
from autopipe.frontend.preserve import preserved
from autopipe.frontend.replay import LayerCall, Values, graph_args, layer_calls, record_values
from autopipe.frontend.timing import MemoryMeter, Timer, median, memory_meter_for, timer_for
from executor._torch_compat import tree_leaves, tree_map_only

__all__ = ["profile", "time_model", "DEFAULT_REPEATS", "DEFAULT_WARMUP"]

DEFAULT_REPEATS = 10
DEFAULT_WARMUP = 2
_CALIBRATION_REPEATS = 50
_TRACE_KWARGS = ("leaf_modules", "max_depth", "kwargs")


# --- measuring one layer -----------------------------------------------------------------------
def _fresh(value: Any) -> Any:
    """A private copy of a recorded value; tensors that need grad become non-leaf clones."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            return t.detach().clone().requires_grad_().clone()
        return t.clone()

    return tree_map_only(torch.Tensor, copy, value)


def _roots(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Output tensors to backpropagate from, with all-ones output gradients."""
    roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        return int(storage.data_ptr()), int(storage.nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested ...)
        return id(t), int(t.numel()) * t.element_size()


def _probe(
    call: LayerCall, values: Values, meter: MemoryMeter, state: set[int]
) -> tuple[int, int | None]:
    """One untimed forward + backward: bytes saved for backward and peak memory."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in state:  # parameters and buffers are state, not activations
            saved[ptr] = nbytes
        return t

    args = _fresh(call.arguments(values))
    meter.start()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call.module(*args)
    roots, grads = _roots(out)
    if roots:
        torch.autograd.backward(roots, grads)
    peak = meter.peak()
    return sum(saved.values()), peak


def _timed_step(timer: Timer, forward: Callable[[], Any]) -> tuple[float, float]:
    """One timed forward and, if its output needs a gradient, one timed backward (ms)."""
    timer.synchronize()
    out, f_ms = timer(forward)
    roots, grads = _roots(out)
    if not roots:
        return f_ms, 0.0
    return f_ms, timer(functools.partial(torch.autograd.backward, roots, grads))[1]


def _time_runs(
    timer: Timer, make_forward: Callable[[], Callable[[], Any]], repeats: int, warmup: int
) -> tuple[float, float]:
    """Median forward and backward ms over ``repeats`` steps after ``warmup`` untimed ones.

    ``make_forward`` returns a fresh zero-argument forward for every step (fresh inputs).
    """
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        f_ms, b_ms = _timed_step(timer, make_forward())
        if i >= warmup:
            fwd.append(f_ms)
            bwd.append(b_ms)
    return median(fwd), median(bwd)


def _time_layer(
    call: LayerCall, values: Values, timer: Timer, repeats: int, warmup: int
) -> tuple[float, float]:
    def make_forward() -> Callable[[], Any]:
        return functools.partial(call.module, *_fresh(call.arguments(values)))

    return _time_runs(timer, make_forward, repeats, warmup)


def _harness_overhead(timer: Timer, device: torch.device) -> tuple[float, float]:
    """Forward and backward ms that timing an EMPTY layer costs: see [Note: harness overhead]."""
    graph = fx.Graph()
    graph.output((graph.placeholder("x"),))
    call = LayerCall("<empty>", fx.GraphModule(nn.Module(), graph), ["x"], ["x"])
    values = Values({"x": torch.zeros(1, device=device, requires_grad=True)})
    return _time_layer(call, values, timer, _CALIBRATION_REPEATS, DEFAULT_WARMUP)


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
    return {_storage_key(t)[0] for t in tensors}


def _dtype(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return str(torch.get_default_dtype()).replace("torch.", "")


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _home(gm: fx.GraphModule) -> torch.device | None:
    tensor = next(iter([*gm.parameters(), *gm.buffers()]), None)
    return None if tensor is None else tensor.device


def _measure(
    model: nn.Module,
    g: LayerGraph,
    args: tuple[Any, ...],
    timer: Timer,
    dev: torch.device,
    repeats: int,
    warmup: int,
    progress: bool | None,
) -> tuple[list[dict[str, Any]], tuple[float, float]]:
    """Every layer's row, and the harness overhead subtracted from each time."""
    values = record_values(g.gm, graph_args(g, args))
    meter = memory_meter_for(dev)
    state = _state_pointers(model, g)
    fwd_extra, bwd_extra = _harness_overhead(timer, dev)
    rows: list[dict[str, Any]] = []
    # [Note: progress on a terminal]: tqdm's disable=None is "off unless the file is a TTY"
    bar = tqdm(layer_calls(g), desc="profiling", unit="layer", file=sys.stderr,
               disable=None if progress is None else not progress, leave=False)
    for call in bar:
        saved, peak = _probe(call, values, meter, state)
        fwd_ms, bwd_ms = _time_layer(call, values, timer, repeats, warmup)
        fwd_ms = max(0.0, fwd_ms - fwd_extra)
        bwd_ms = max(0.0, bwd_ms - bwd_extra) if bwd_ms > 0 else 0.0
        rows.append(_row(g, call.name, fwd_ms, bwd_ms, saved, peak))
    return rows, (fwd_extra, bwd_extra)


def profile(
    model: nn.Module,
    example_inputs: Any,
    *,
    device: str | torch.device = "cpu",
    chunks: int = 1,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    graph: LayerGraph | None = None,
    name: str | None = None,
    progress: bool | None = None,
    timer: Timer | None = None,
    **trace_kwargs: Any,
) -> Profile:
    """Measure every layer of ``model`` on one micro-batch of ``example_inputs``.

    Args:
        model: the model to profile (left as it was: see [Note: profiling leaves the model
            as it was]).
        example_inputs: one full batch of positional inputs (a tensor or a tuple).
        device: "cpu" or "cuda[:N]": where to measure (the model is moved there and back).
        chunks: micro-batches per batch; one micro-batch is ``ceil(batch / chunks)`` rows.
        repeats: timed runs per layer; the profile holds the median.
        warmup: untimed runs per layer before the timed ones.
        graph: a LayerGraph already traced on one micro-batch (else it is traced here).
        name: the model's name in the metadata (default: its class name).
        progress: a progress bar over the layers on stderr: None (default) shows it when
            stderr is a terminal, True always, False never.
        timer: how to time a call (default: the device's, see autopipe.frontend.timing).
        **trace_kwargs: ``leaf_modules``, ``max_depth``, ``kwargs`` for :func:`autopipe.trace`.

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
    if progress is not None and not isinstance(progress, bool):
        raise ProfileError(f"progress must be True, False or None (a bar when stderr is a "
                           f"terminal), got {progress!r}")
    inputs, batch, micro = micro_batch(example_inputs, chunks)
    dev = target_device(device)
    if graph is not None:
        _check_graph(graph, inputs, micro, chunks)
    with preserved(model, dev):
        args = to_device(inputs, dev)
        g = graph if graph is not None else trace(model, args, **trace_kwargs)
        home = _home(g.gm)  # a caller's graph goes back where it was
        try:
            g.gm.to(dev)
            rows, (fwd_extra, bwd_extra) = _measure(
                model, g, args, timer or timer_for(dev), dev, repeats, warmup, progress
            )
        finally:
            if home is not None and graph is not None:
                g.gm.to(home)
    meta = {
        "model": name or type(model).__name__,
        "device": _device_name(dev),
        "device_type": dev.type,
        "dtype": _dtype(model),
        "batch_size": batch,
        "chunks": chunks,
        "micro_batch_size": micro,
        "repeats": repeats,
        "warmup": warmup,
        "cpu_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "fingerprint": g.fingerprint,
        "harness_fwd_ms": round(fwd_extra, 6),
        "harness_bwd_ms": round(bwd_extra, 6),
        "source": g.source,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return Profile(pd.DataFrame(rows), g.edges(), meta)


def _row(g: LayerGraph, layer: str, fwd_ms: float, bwd_ms: float, saved: int, peak: int | None) -> dict[str, Any]:
    a = g.nx.nodes[layer]
    return {
        "layer": layer,
        "fwd_ms": round(fwd_ms, 6),
        "bwd_ms": round(bwd_ms, 6),
        "param_bytes": int(a["param_bytes"]),
        "output_bytes": int(a["output_bytes"]),
        "saved_bytes": saved,
        "peak_bytes": float("nan") if peak is None else float(peak),
        "buffer_bytes": int(a["buffer_bytes"]),
        "shared_bytes": int(a["shared_bytes"]),
        "tie_group": str(a["tie_group"]),
        "kind": str(a["kind"]),
        "module_type": str(a["module_type"]),
    }


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
) -> tuple[float, float]:
    """Median forward and backward ms of the WHOLE model on one micro-batch.

    The peer measurement for a profile: the sum of a profile's per-layer times should be
    close to this (benchmarks/profile_accuracy.py reports the ratio).
    """
    _check_counts(repeats, warmup)
    inputs, _, _ = micro_batch(example_inputs, chunks)
    dev = target_device(device)
    with preserved(model, dev):
        args, timer = to_device(inputs, dev), timer or timer_for(dev)
        return _time_runs(
            timer, lambda: functools.partial(model, *_fresh(args), **(kwargs or {})), repeats, warmup
        )
