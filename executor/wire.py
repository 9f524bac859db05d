"""How a stage's live values cross a process boundary as tensors.

[Note: what crosses a cut] Our stages take and return the tuple of values live at a cut
(DESIGN.md "Stages are a linear chain"), and those may be Python values: ``n = x.size(1)``
used after the cut is an ``int``, an optional argument may be ``None``. PipelineStage sends
tensors only, so each stage runs inside a :class:`WireStage` that encodes its outputs and
decodes its inputs following a :class:`Wire` per value, fixed at build time by
:func:`infer_wires` (one probe run of the whole chain on the example micro-batch): a tensor is
sent as is; an ``int``/``float``/``bool`` as a 0-d int64/float64 tensor and a ``torch.Size``
(or tuple/list of ints) as a 1-d int64 tensor, decoded back to the same Python type, so values
that depend on the micro-batch stay exact; anything else (``None``, a dtype, a string) is a
constant baked into both sides and never sent, and the sender checks that it did not change.
The last stage's output (any pytree, e.g. a HuggingFace ModelOutput) is flattened to its
tensor leaves for the schedule and rebuilt before ``loss_fn`` sees it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from executor._torch_compat import TreeSpec, tree_flatten, tree_unflatten
from executor.errors import DistributedError

__all__ = ["Wire", "WireStage", "infer_wires", "wire_metas"]


@dataclass(frozen=True)
class Wire:
    """How one value live at a cut crosses ranks: ``tensor``, ``scalar``, ``ints`` or ``const``.

    ``shape``/``stride``/``dtype``/``requires_grad`` describe the tensor on the wire (at the
    example micro-batch): PipelineStage gets them up front and skips its metadata inference.
    """

    kind: str
    pytype: type | None = None  # int / float / bool for scalars; tuple / list / Size for ints
    value: Any = None  # the constant, for kind == "const"
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    requires_grad: bool = False

    @staticmethod
    def of(value: Any) -> Wire:
        if isinstance(value, Tensor):
            return Wire("tensor", None, None, tuple(value.shape), tuple(value.stride()), value.dtype,
                        value.requires_grad)
        if isinstance(value, (bool, int, float)):
            return Wire("scalar", type(value), dtype=torch.float64 if isinstance(value, float) else torch.int64)
        if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return Wire("ints", type(value), shape=(len(value),), stride=(1,))
        return Wire("const", None, value)

    def meta(self) -> Tensor | None:
        """An example of the tensor on the wire (meta device), or None for a constant."""
        if self.kind == "const":
            return None
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad)


def wire_metas(wires: Sequence[Wire]) -> tuple[Tensor, ...]:
    return tuple(t for t in (w.meta() for w in wires) if t is not None)


def _encode(values: Sequence[Any], wires: Sequence[Wire], device: torch.device) -> tuple[Tensor, ...]:
    if len(values) != len(wires):
        raise DistributedError(f"a stage returned {len(values)} values but its cut carries {len(wires)}; "
                               "rebuild the pipeline from the same model and plan on every rank")
    out: list[Tensor] = []
    for k, (value, wire) in enumerate(zip(values, wires, strict=True)):
        if wire.kind == "tensor":
            out.append(value)
        elif wire.kind == "scalar":
            out.append(torch.tensor(value, dtype=wire.dtype, device=device))
        elif wire.kind == "ints":
            out.append(torch.tensor(list(value), dtype=torch.int64, device=device))
        elif not _same(value, wire.value):
            raise DistributedError(
                f"cut value {k} was the constant {wire.value!r} when the pipeline was built but is "
                f"{value!r} now; such values are not sent, so keep it fixed or make it a tensor"
            )
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 - values without a usable == are compared by identity only
        return False


def _decode(tensors: Sequence[Tensor], wires: Sequence[Wire]) -> tuple[Any, ...]:
    it: Iterator[Tensor] = iter(tensors)
    out: list[Any] = []
    for wire in wires:
        if wire.kind == "tensor":
            out.append(next(it))
        elif wire.kind == "scalar":
            assert wire.pytype is not None
            out.append(wire.pytype(next(it).item()))
        elif wire.kind == "ints":
            assert wire.pytype is not None
            out.append(wire.pytype(int(v) for v in next(it).tolist()))
        else:
            out.append(wire.value)
    return tuple(out)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


@contextmanager
def _probing(stages: Sequence[nn.Module]) -> Iterator[None]:
    """Eval mode (no BatchNorm statistic updates) and a forked RNG, restored afterwards."""
    modes = [(m, m.training) for s in stages for m in s.modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for s in stages:
                s.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


def infer_wires(stages: Sequence[nn.Module], example_inputs: tuple[Any, ...]) -> list[tuple[Wire, ...]]:
    """The wires of every cut from one probe run of the chain (with autograd, so that
    ``requires_grad`` is known): cut 0 is the model's inputs, cut ``i`` stage ``i``'s inputs,
    and the extra last cut the tensor leaves of the model's output (what the loss receives)."""
    bad = [k for k, v in enumerate(example_inputs) if not isinstance(v, Tensor)]
    if bad:
        raise DistributedError(
            f"model inputs {bad} are not tensors; torch.distributed.pipelining feeds the first "
            "stage tensors only: pass non-tensor arguments as constants of the model instead"
        )
    wires: list[tuple[Wire, ...]] = []
    values: tuple[Any, ...] = tuple(example_inputs)
    with _probing(stages):
        for i, stage in enumerate(stages):
            wires.append(tuple(Wire.of(v) for v in values))
            out = stage(*values)
            values = _as_tuple(out) if i < len(stages) - 1 else tuple(tree_flatten(out)[0])
        wires.append(tuple(Wire.of(v) for v in values if isinstance(v, Tensor)))
    return wires


class WireStage(nn.Module):
    """One stage as PipelineStage sees it: wire tensors in, wire tensors out.

    ``last`` marks the last stage: its output pytree is flattened to tensor leaves
    and :meth:`unflatten` rebuilds it for the loss. ``recompute`` is set per micro-batch by
    the pipeline (see [Note: distributed recomputation]).
    """

    def __init__(
        self, stage: nn.Module, inputs: Sequence[Wire], outputs: Sequence[Wire], *, last: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.last = last
        self.device = device
        self.recompute = False
        self._spec: TreeSpec | None = None
        self._consts: list[tuple[int, Any]] = []

    def forward(self, *wire: Tensor) -> tuple[Tensor, ...]:
        if self.recompute and self.stage.training and torch.is_grad_enabled():
            out: tuple[Tensor, ...] = torch_checkpoint(
                self._run, *wire, use_reentrant=False, preserve_rng_state=True
            )
            return out
        return self._run(*wire)

    def _run(self, *wire: Tensor) -> tuple[Tensor, ...]:
        out = self.stage(*_decode(wire, self.inputs))
        if not self.last:
            return _encode(_as_tuple(out), self.outputs, self.device)
        leaves, self._spec = tree_flatten(out)
        self._consts = [(k, v) for k, v in enumerate(leaves) if not isinstance(v, Tensor)]
        return tuple(v for v in leaves if isinstance(v, Tensor))

    def unflatten(self, tensors: Tensor | tuple[Tensor, ...]) -> Any:
        """The last stage's output as the model returns it, from its tensor leaves."""
        assert self._spec is not None, "unflatten before the last stage ran"
        it = iter(_as_tuple(tensors))
        consts = dict(self._consts)
        leaves = [consts[k] if k in consts else next(it) for k in range(self._spec.num_leaves)]
        return tree_unflatten(leaves, self._spec)


