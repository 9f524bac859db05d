"""``autopipe calibrate``: this device measured into a device sheet, its efficiencies fitted.

    sheet = calibrate("cpu")          # or "cuda:0"; sheet.save("sheets/cpu.json")

[Note: calibrated sheets] A shipped sheet's peaks are a datasheet's and its efficiencies
assumed; a calibrated one is this device's own, measured through the timer the profiler uses
(harness/timing.py) and fitted through the very counting and roofline an estimate uses
([Note: counted, not timed], [Note: roofline]), so that an estimate on it reproduces what the
measured ops took:

- ``peak_flops_<dtype>``: the best rate of square matmuls in that dtype, each size doubled
  until one takes ``BIG_MS`` (or the size reaches ``MAX_SIDE``);
- ``memory_bandwidth``: a copy of ``COPY_BYTES``, read and written, over its time;
- ``efficiency_<class>`` and ``launch_us``: a few dozen layers (Linear and Conv2d of several
  sizes, causal and full attention, add, GELU, softmax, LayerNorm, from launch-bound to large,
  in fp32 and bf16) each run one training step, forward and backward, timed; the same step is
  counted on fake tensors of the same shapes, each op's roofline at full efficiency summed per
  class, R_c. Then 1 / e_c and the launch floor L are the least-squares solution of
  ``sum_c R_c / e_c + ops x L = measured`` over the layers, in relative error, so that an
  estimate on the sheet reproduces what they took; an efficiency above 1 (a class beat this
  device's own measured peaks, as small tensors in cache do) is 1, and its source says so.
  L is then what an op costs beyond its roofline in a training step: launch, dispatch, the
  autograd node it records;
- ``memory_bytes``: the device's (the host's physical memory for a CPU);
- the links are not measured: ``autopipe comm`` times a link between ranks; the sheet takes
  autopipe's default between stages (``DEFAULT_BANDWIDTH``) and says so; edit them to your
  hosts'.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from autopipe.core.device_sheet import COMPUTE_DTYPES, OP_CLASSES, DeviceSheet
from autopipe.core.transfer import DEFAULT_BANDWIDTH
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.estimated.op_counts import Op, OpCounter
from autopipe.frontend.profiling.harness.inputs import target_device
from autopipe.frontend.profiling.harness.timing import Timer, median, timer_for
from executor._torch_compat import FakeTensorMode

__all__ = ["calibrate", "fit_efficiencies", "Shape", "shapes_for"]

BIG_MS = 50.0  # a matmul this long runs near the device's peak
MAX_SIDE = {"cpu": 2048, "cuda": 16384}
COPY_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Shape:
    """One measured layer of a class of op: ``make(device)`` builds its module and inputs (once,
    outside the timing) and returns one training step of it, forward and backward."""

    def __init__(self, label: str, make: Callable[[torch.device], Callable[[], Any]]) -> None:
        self.label, self.make = label, make


def _step(module: Callable[..., Any], params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
          dtype: str, dev: torch.device) -> Callable[[], Any]:
    """Forward (under autocast for a low dtype) and backward, the gradients of the last step
    dropped first, so that every step is the first micro-batch's."""
    low = dtype != "fp32"

    def step() -> None:
        for p in params:
            p.grad = None
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        with torch.autocast(dev.type, dtype=_DTYPE[dtype], enabled=low):
            out = module(*xs)
        out.backward(torch.ones_like(out))
    return step


def _linear(t: int, i: int, o: int, dtype: str) -> Shape:
    def make(dev: torch.device) -> Callable[[], Any]:
        layer = torch.nn.Linear(i, o, device=dev)
        return _step(layer, list(layer.parameters()), [torch.randn(t, i, device=dev)], dtype, dev)
    return Shape(f"Linear {t}x{i}->{o} {dtype}", make)


def _conv(n: int, c: int, hw: int, o: int, dtype: str) -> Shape:
    def make(dev: torch.device) -> Callable[[], Any]:
        layer = torch.nn.Conv2d(c, o, 3, padding=1, device=dev)
        return _step(layer, list(layer.parameters()), [torch.randn(n, c, hw, hw, device=dev)], dtype, dev)
    return Shape(f"Conv2d {n}x{c}x{hw}x{hw}->{o} {dtype}", make)


def _attention(b: int, h: int, s: int, d: int, dtype: str, causal: bool) -> Shape:
    def make(dev: torch.device) -> Callable[[], Any]:
        qkv = [torch.randn(b, h, s, d, device=dev) for _ in range(3)]
        return _step(functools.partial(F.scaled_dot_product_attention, is_causal=causal), [], qkv, dtype, dev)
    return Shape(f"sdpa {b}x{h}x{s}x{d} {dtype}{' causal' if causal else ''}", make)


def _elementwise(kind: str, n: int, dtype: str) -> Shape:
    def make(dev: torch.device) -> Callable[[], Any]:
        norm = torch.nn.LayerNorm(1024, device=dev)
        ops: dict[str, Callable[..., Any]] = {"gelu": F.gelu, "layer_norm": norm, "add": torch.add,
                                              "softmax": functools.partial(torch.softmax, dim=-1)}
        fn = ops[kind]
        inputs = [torch.randn(n // 1024, 1024, device=dev) for _ in range(2 if kind == "add" else 1)]
        return _step(fn, list(norm.parameters()) if kind == "layer_norm" else [], inputs, dtype, dev)
    return Shape(f"{kind} {n} {dtype}", make)


def shapes_for(device_type: str) -> list[Shape]:
    """The layers measured: what a transformer's and a CNN's layers run, small to large, in fp32
    and in bf16 (what mixed precision computes in)."""
    x = 1 if device_type == "cpu" else 8
    shapes = [_linear(t * x, i * x, o * x, dtype) for t, i, o in ((512, 128, 384), (64, 512, 512), (512, 512, 512),
                                                                 (2048, 256, 1024), (256, 1024, 256))
              for dtype in ("fp32", "bf16")]
    shapes += [_conv(n, c * x, hw, o * x, "fp32") for n, c, hw, o in ((16, 3, 32, 16), (16, 16, 32, 16), (8, 64, 16, 64))]
    shapes += [_attention(b, h, s * x, d, dtype, causal) for b, h, s, d in ((8, 4, 64, 32), (2, 8, 256, 64))
               for dtype in ("fp32", "bf16") for causal in (False, True)]
    shapes += [_elementwise(kind, n * x, dtype) for kind in ("add", "gelu", "softmax", "layer_norm")
               for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22) for dtype in ("fp32", "bf16")]
    shapes += [_linear(8, 16, 16, dtype) for dtype in ("fp32", "bf16")]  # launch-bound: they pin the floor
    return shapes


def _time(timer: Timer, call: Callable[[], Any], repeats: int) -> float:
    call()  # warm: the first call of an op pays its one-time set-up
    timer.synchronize()
    return median([timer(call)[1] for _ in range(repeats)])


def _count(shape: Shape) -> list[Op]:
    with FakeTensorMode(allow_non_fake_inputs=True):
        call = shape.make(torch.device("cpu"))
        with OpCounter() as counter:
            call()
    return counter.ops


def fit_efficiencies(rooflines: Sequence[Mapping[str, float]], ops: Sequence[int],
                     measured_ms: Sequence[float]) -> tuple[dict[str, float], float]:
    """Each op class's efficiency e_c and the launch floor L (ms) such that
    ``sum_c rooflines[i][c] / e_c + ops[i] x L`` is ``measured[i]`` for every shape i as nearly
    as can be, in relative terms (least squares on 1 / e_c and L: [Note: calibrated sheets]);
    e_c is 1 for a class no shape ran or that beat the roofline, L is None-free: at least 0.1 us."""
    classes = [c for c in OP_CLASSES if any(r.get(c, 0.0) > 0 for r in rooflines)]
    t = np.asarray(measured_ms, dtype=float)
    a = np.array([[*(r.get(c, 0.0) for c in classes), n] for r, n in zip(rooflines, ops, strict=True)],
                 dtype=float) / t[:, None]
    solution = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)[0]
    fitted = {c: float(1.0 / x) if x > 1.0 else 1.0 for c, x in zip(classes, solution[:-1], strict=True)}
    return {c: fitted.get(c, 1.0) for c in OP_CLASSES}, max(float(solution[-1]), 1e-4)


def _peak(timer: Timer, dev: torch.device, dtype: str, repeats: int) -> tuple[float, str]:
    best, side, where = 0.0, 64, ""
    while side <= MAX_SIDE[dev.type]:
        a, b = (torch.randn(side, side, device=dev, dtype=_DTYPE[dtype]) for _ in range(2))
        ms = _time(timer, functools.partial(torch.mm, a, b), repeats)
        rate = 2 * side**3 / (ms / 1e3)
        if rate > best:
            best, where = rate, f"mm {side}x{side}x{side} {dtype} in {ms:.3f} ms"
        if ms > BIG_MS:
            break
        side *= 2
    return best, where


def _memory_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_text(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} torch thread(s)"


def calibrate(device: str | torch.device = "cpu", *, name: str | None = None, repeats: int = 5,
              shapes: Sequence[Shape] | None = None, timer: Timer | None = None) -> DeviceSheet:
    """This device measured into a DeviceSheet ([Note: calibrated sheets]): its launch floor, peak
    matmul rate per dtype, copy bandwidth and memory, and each op class's efficiency fitted."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be an int >= 1, got {repeats!r}")
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        kind = str(device)
    if kind not in ("cpu", "cuda"):
        raise ProfileError(f"calibrate measures a cpu or a cuda device, not {str(device)!r}; pass --device cpu or cuda:N")
    dev = target_device(device)  # a cuda device that is not there: one line
    timer = timer or timer_for(dev)
    date = datetime.date.today().isoformat()
    said = f"measured by autopipe calibrate on {_device_text(dev)}, {date}"
    numbers: dict[str, float] = {"launch_us": 1.0}  # fitted below
    sources: dict[str, str] = {}
    for dtype in COMPUTE_DTYPES:
        numbers[f"peak_flops_{dtype}"], where = _peak(timer, dev, dtype, repeats)
        sources[f"peak_flops_{dtype}"] = f"{said}: the best of square matmuls, {where}"
    copy_elems = COPY_BYTES[dev.type] // 4
    src, dst = torch.empty(copy_elems, device=dev), torch.empty(copy_elems, device=dev)
    copy_ms = _time(timer, functools.partial(dst.copy_, src), repeats)
    numbers["memory_bandwidth"] = 2 * 4 * copy_elems / (copy_ms / 1e3)
    sources["memory_bandwidth"] = f"{said}: a copy of {4 * copy_elems >> 20} MiB, read and written, in {copy_ms:.3f} ms"
    full = _sheet(name or f"{dev.type}-calibrated", dev, numbers, dict.fromkeys(OP_CLASSES, 1.0), {})
    rooflines: list[dict[str, float]] = []
    counts: list[int] = []
    measured: list[float] = []
    for shape in shapes if shapes is not None else shapes_for(dev.type):
        ops = _count(shape)
        per_class: dict[str, float] = {}
        for o in ops:  # each op's roofline at full efficiency, without its launch
            per_class[o.op_class] = per_class.get(o.op_class, 0.0) + full.op_ms(o.op_class, o.dtype, o.flops,
                                                                                   o.nbytes) - full.launch_us / 1e3
        rooflines.append(per_class)
        counts.append(len(ops))
        measured.append(_time(timer, shape.make(dev), repeats))
    efficiency, launch_ms = fit_efficiencies(rooflines, counts, measured)
    numbers["launch_us"] = launch_ms * 1e3
    fit = f"{said}: fitted over {len(measured)} layers' forward and backward, least squares of their relative error"
    sources["launch_us"] = f"{fit} (what each op costs beyond its roofline: launch, dispatch, autograd)"
    for c in OP_CLASSES:
        sources[f"efficiency_{c}"] = fit + (", 1: none ran or they beat the roofline" if efficiency[c] == 1.0 else "")
    sources.update(
        name="autopipe calibrate's name for this device", device=said, device_type=said,
        memory_bytes=f"{said}: {'torch.cuda total_memory' if dev.type == 'cuda' else 'the host physical memory'}",
        intra_host_bandwidth="not measured: autopipe's default between stages (core/transfer.py "
                             "DEFAULT_BANDWIDTH); autopipe comm measures a link, edit this to it",
        inter_host_bandwidth="not measured: autopipe's default between stages (core/transfer.py "
                             "DEFAULT_BANDWIDTH); autopipe comm measures a link, edit this to it")
    return _sheet(full.name, dev, numbers, efficiency, sources)


def _sheet(name: str, dev: torch.device, numbers: Mapping[str, float], efficiency: Mapping[str, float],
           sources: dict[str, str]) -> DeviceSheet:
    return DeviceSheet(
        name=name, device=_device_text(dev), device_type=dev.type, peak_flops_bf16=numbers["peak_flops_bf16"],
        peak_flops_fp16=numbers["peak_flops_fp16"], peak_flops_fp32=numbers["peak_flops_fp32"],
        memory_bandwidth=numbers["memory_bandwidth"], memory_bytes=_memory_bytes(dev),
        intra_host_bandwidth=DEFAULT_BANDWIDTH, inter_host_bandwidth=DEFAULT_BANDWIDTH,
        efficiency_matmul=efficiency["matmul"], efficiency_attention=efficiency["attention"],
        efficiency_elementwise=efficiency["elementwise"], launch_us=numbers["launch_us"], sources=sources)
