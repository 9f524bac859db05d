"""Every op a call runs, counted: its class, compute dtype, FLOPs and bytes, and its time on a sheet.

    timer = CountingTimer(load_sheet("h100"))
    out, ms = timer(lambda: layer(x))      # x: fake tensors; ms: the ops' estimated time
    timer.ops                              # [Op("matmul", "bf16", flops, nbytes), ...]

[Note: counted, not timed] An estimated profile is measured by the same harness as a real one
(layer_rows.py: probe, the timed forward and backward, the split backward, the recompute
sample), on fake tensors, with :class:`CountingTimer` in place of a clock: "timing" a call runs
it under :class:`OpCounter` and sums the device sheet's roofline ([Note: roofline] in
autopipe/core/device_sheet.py) over the ops it ran. Each call the harness times is one phase, a
forward or a backward, so nothing here tells the two apart, and every column of a measured
profile (saved bytes, the split backward's two halves, the recompute ratio) comes out of the
same code as when measured.

Per op: FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` counts them (matmuls,
convolutions, attention; the CPU's flash attention, which torch's registry lacks, by torch's own
``sdpa_flop_count`` formulas, half of it under ``is_causal``: a flash kernel skips the masked
blocks); bytes as what the op reads and writes, every tensor argument and result once, whole
(an in-place op reads and writes its first argument; ``copy_`` only writes it).
Ops that launch no kernel cost nothing: views (``func.is_view``, and ``_unsafe_view``, which
its schema does not mark), ``prim`` ops, and allocations (``empty`` & co.). The class is
``attention`` for the attention kernels, ``matmul`` for any other op with FLOPs, ``elementwise``
for the rest (norms, activations, casts, copies, sums).
The compute dtype is the first floating tensor argument's. Cache effects, fusion and the
overlap of a kernel with the next one's launch are not modelled. A parameter's gradient is
accumulated into the one before (an ``add_``), as for every micro-batch but a step's first: the
probe the harness runs first leaves one, as when measured.

What the harness adds is not counted: the timer sees only kernels, so no empty layer's cost is
subtracted ([Note: harness overhead]: a clock sees the harness's calls, a count does not), and
the one kernel the harness makes a layer run, AccumulateGrad's copy of a gradient into the
fresh leaf the harness gives the layer as input (``new_empty_strided`` then ``copy_`` into it,
during a backward), is left out: in a pipeline a layer's input is another layer's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autopipe.core.device_sheet import DeviceSheet
from autopipe.frontend.profiling.harness.timing import Timer
from executor._torch_compat import TorchDispatchMode, tree_leaves

__all__ = ["Op", "OpCounter", "CountingTimer", "op_class", "FREE_OPS"]

T = TypeVar("T")
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FREE_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                      "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "sym_size", "sym_numel",
                      "sym_stride", "sym_storage_offset", "set_", "_unsafe_view"})
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
              "flex_attention")


@dataclass(frozen=True)
class Op:
    """One kernel: its class, compute dtype, FLOPs and the bytes it reads and writes."""

    op_class: str
    dtype: str
    flops: int
    nbytes: int


def op_class(name: str, flops: int) -> str:
    """``attention``, ``matmul`` (any other op with FLOPs) or ``elementwise``."""
    if any(part in name for part in _ATTENTION):
        return "attention"
    return "matmul" if flops > 0 else "elementwise"


def _cpu_flash(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
               *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value) // (2 if is_causal else 1)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
                        dropout_p: float = 0.0, is_causal: bool = False, *args: Any,
                        out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value) // (2 if is_causal else 1)


_CUSTOM = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}


def _tensor_bytes(values: Any) -> tuple[int, str | None]:
    """Bytes of every distinct tensor in ``values``, and the first floating one's dtype."""
    seen: set[int] = set()
    total, dtype = 0, None
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
            if dtype is None and t.is_floating_point():
                dtype = _DTYPES.get(t.dtype, "fp32")
    return total, dtype


class _Global:
    """FlopCounterMode's module tracker for totals only: every count goes to ``"Global"``. Its
    own ModuleTracker hooks every module's forward, and under a reentrant checkpoint (the
    recompute sampler's, autopipe/frontend/profiling/corrections/overheads.py) those hooks meet
    outputs that require a gradient without a function and assert (HF Llama: torch 2.11-2.15)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Global:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class OpCounter(TorchDispatchMode):
    """Every kernel of what runs inside it ([Note: counted, not timed]), in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._flops = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
        self._flops.mod_tracker = _Global()  # type: ignore[assignment]  # totals only: no module hooks
        self._fresh: int | None = None  # the tensor the last op allocated during a backward

    def __enter__(self) -> OpCounter:
        self._flops.__enter__()  # below this mode: it counts each op this mode passes on
        try:
            super().__enter__()
        except BaseException:
            self._flops.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._flops.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = self._flops.get_total_flops()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        fresh, self._fresh = self._fresh, None
        if name == "new_empty_strided" and not torch.is_grad_enabled():
            self._fresh = id(out)  # maybe AccumulateGrad's clone of a gradient: see copy_ below
        if name == "copy_" and fresh is not None and id(args[0]) == fresh:
            return out  # a gradient cloned into a leaf of the harness's: no pipeline layer pays it
        if func.namespace == "prim" or func.is_view or name in FREE_OPS:
            return out
        flops = int(self._flops.get_total_flops() - before)
        read, dtype = _tensor_bytes((args[1:], kwargs) if name == "copy_" else (args, kwargs))  # copy_ reads no dst
        written, out_dtype = _tensor_bytes(out)
        self.ops.append(Op(op_class(name, flops), dtype or out_dtype or "fp32", flops, read + written))
        return out


class CountingTimer(Timer):
    """A Timer that counts instead of timing ([Note: counted, not timed]): a call's time is the
    sheet's roofline summed over the ops it ran; ``ops`` holds the last call's. It sees only
    kernels, so the harness costs it nothing (``harness_cost``)."""

    harness_cost = False

    def __init__(self, sheet: DeviceSheet) -> None:
        self.sheet = sheet
        self.ops: list[Op] = []

    def __call__(self, fn: Callable[[], T]) -> tuple[T, float]:
        with OpCounter() as counter:
            out = fn()
        self.ops = counter.ops
        return out, self.ms(counter.ops)

    def ms(self, ops: list[Op]) -> float:
        """The estimated milliseconds of ``ops`` on the sheet's device, one after another."""
        return sum(self.sheet.op_ms(op.op_class, op.dtype, op.flops, op.nbytes) for op in ops)
