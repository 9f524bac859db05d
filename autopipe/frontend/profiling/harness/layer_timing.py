"""Time and measure one layer alone, forward and backward, on copies of the values it reads.

[Note: in-place layers] A layer's inputs are recorded once and cloned before every repeat, and
an input that needs a gradient is passed as a non-leaf clone of a fresh leaf. So a layer that
writes its input in place (``ReLU(inplace=True)``) neither corrupts the recorded values of later
repeats nor trips autograd's "leaf variable used in an in-place operation" check; torchgpipe's
profiler breaks on exactly that.

[Note: harness overhead] Timing a layer alone adds costs the real pipeline does not pay: the
call of the layer's GraphModule, and above all one ``torch.autograd.backward`` call per layer
(engine start-up, the input's clone and gradient accumulation), tens of microseconds on a
CPU. For a small layer that is more than its work. The profiler times an EMPTY layer (inputs -> outputs,
no op) through the very same code path and subtracts its median from every layer's (clamped at
zero); the amounts are recorded in the metadata as ``harness_fwd_ms`` / ``harness_bwd_ms``.
benchmarks/profile_accuracy.py checks the result: the sum over layers against a whole-model
forward + backward of the same micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from autopipe.frontend.profiling.harness.replay import LayerCall, Values
from autopipe.frontend.profiling.harness.timing import MemoryMeter, Timer, median
from executor._torch_compat import tree_leaves, tree_map_only
from executor.memory_meter import MemoryMeter as LiveBytes

__all__ = ["probe", "shared_saved", "time_layer", "time_runs", "harness_overhead", "fresh", "storage_key",
           "leaves_as_views"]

CALIBRATION_REPEATS = 50
CALIBRATION_WARMUP = 2


def fresh(value: Any) -> Any:
    """A private copy of a recorded value; tensors that need grad become non-leaf clones."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            return t.detach().clone().requires_grad_().clone()
        return t.clone()

    return tree_map_only(torch.Tensor, copy, value)


def leaves_as_views(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose output tensors that are leaves needing a gradient come back as views.

    [Note: a layer that returns a parameter] A layer can return one of the model's parameters
    itself: ``aten.to.dtype`` to the dtype a tensor already has returns that tensor, and torch.export
    writes one for every parameter a HF model casts (Mamba's ``dt_proj.bias.float()``). Run
    inside an autograd Function (torch's reentrant checkpoint), such an output becomes the
    Function's output: autograd gives the parameter ITSELF the Function's ``grad_fn``, so it is no
    longer a leaf, every later use of it extends that history, and each backward re-enters every
    earlier checkpoint's recomputation: time and memory grow with every repeat of every layer
    (a 3-block Mamba profiled past 24 GiB). A view of the leaf is an output of its own, and the
    gradient still reaches the parameter through it.
    """

    def call(*args: Any) -> Any:
        return tree_map_only(torch.Tensor, _view_of_leaf, fn(*args))

    return call


def _view_of_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t) if t.is_leaf and t.requires_grad else t


def backward_roots(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Output tensors to backpropagate from, with all-ones output gradients."""
    roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":  # meta and fake tensors have no address: the storage object is
            return id(storage), int(storage.nbytes())  # one per live storage ([Note: counted, not timed])
        return int(storage.data_ptr()), int(storage.nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested ...)
        return id(t), int(t.numel()) * t.element_size()


def probe(
    call: LayerCall, values: Values, meter: MemoryMeter, state: set[int]
) -> tuple[int, list[int], int, int, int | None, int]:
    """One untimed forward + backward: bytes saved for backward (all, of them each input's,
    of them the outputs', of them inputs written in place and saved as outputs), peak memory
    ([Note: saved once]) and the backward's working set: the most bytes it has alive at once
    beyond what it starts from (the saves, the output, the gradient it receives), its inputs'
    and weights' gradients and its kernels' temporaries, as live storage ([Note: the backward's
    memory] in autopipe/core/stage_memory.py)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = storage_key(t)
        if ptr not in state:  # parameters and buffers are state, not activations
            saved[ptr] = nbytes
        return t

    args = fresh(call.arguments(values))
    meter.start()
    live = LiveBytes()
    with live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(*args)
        roots, grads = backward_roots(out)
        start = live.live
        live.reset_peak()
        if roots:
            torch.autograd.backward(roots, grads)
    peak = meter.peak()

    def keys(value: Any) -> set[int]:
        return {storage_key(t)[0] for t in tree_leaves(value) if isinstance(t, torch.Tensor)}

    def of(value: Any) -> int:
        return sum(n for k, n in saved.items() if k in keys(value))

    written = keys(args) & keys(out)  # an in-place layer's output is its input's storage
    return (sum(saved.values()), [of(a) for a in args], of(out), sum(saved.get(k, 0) for k in written), peak,
            max(live.peak - start, 0))


def shared_saved(edges: Iterable[tuple[str, str, int]],
                 ends: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """[Note: saved once] Of what each layer saves of its inputs, the bytes that are held
    anyway: the graph's inputs (the caller's batch) and what its producers already save as
    their outputs (``min(the rest, sum of the producers' saved outputs)``)."""
    produced: dict[str, int] = dict.fromkeys(ends, 0)
    for src, dst, _ in edges:
        produced[dst] += ends[src][2]
    return {name: batch + min(saved_in - batch, produced[name])
            for name, (saved_in, batch, _) in ends.items()}


def timed_step(timer: Timer, forward: Callable[[], Any]) -> tuple[float, float]:
    """One timed forward and, if its output needs a gradient, one timed backward (ms)."""
    timer.synchronize()
    out, f_ms = timer(forward)
    roots, grads = backward_roots(out)
    if not roots:
        return f_ms, 0.0
    return f_ms, timer(functools.partial(torch.autograd.backward, roots, grads))[1]


def time_runs(
    timer: Timer, make_forward: Callable[[], Callable[[], Any]], repeats: int, warmup: int
) -> tuple[float, float]:
    """Median forward and backward ms over ``repeats`` steps after ``warmup`` untimed ones.

    ``make_forward`` returns a fresh zero-argument forward for every step (fresh inputs).
    """
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        f_ms, b_ms = timed_step(timer, make_forward())
        if i >= warmup:
            fwd.append(f_ms)
            bwd.append(b_ms)
    return median(fwd), median(bwd)


def time_layer(
    call: LayerCall, values: Values, timer: Timer, repeats: int, warmup: int
) -> tuple[float, float]:
    def make_forward() -> Callable[[], Any]:
        return functools.partial(call, *fresh(call.arguments(values)))

    return time_runs(timer, make_forward, repeats, warmup)


def harness_overhead(timer: Timer, device: torch.device, precision: str = "fp32") -> tuple[float, float]:
    """Forward and backward ms that timing an EMPTY layer costs: see [Note: harness overhead]
    (entering the precision's autocast included: [Note: profiling under a precision])."""
    graph = fx.Graph()
    graph.output((graph.placeholder("x"),))
    call = LayerCall("<empty>", fx.GraphModule(nn.Module(), graph), ["x"], ["x"], precision, device)
    values = Values({"x": torch.zeros(1, device=device, requires_grad=True)})
    return time_layer(call, values, timer, CALIBRATION_REPEATS, CALIBRATION_WARMUP)
