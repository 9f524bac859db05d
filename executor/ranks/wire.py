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

[Note: a view crosses once] A cut may carry a tensor and a reshape of it: an HF causal LM cut
before its loss carries the logits it returns and their ``view(-1, vocab)`` that cross-entropy
reads. Sent as two messages they cross twice, and the receiver (and the sender, for their
gradients) keeps a buffer per micro-batch for each ([Note: receive buffers] in
autopipe/core/stage_memory.py): twice the logits' bytes on each side. :func:`with_views` finds,
on the probe run, each tensor of a cut between ranks that is an earlier one reshaped (the same
memory, both contiguous) and makes it a ``view`` wire: not sent, rebuilt by the receiver as a
view of its source at the step's sizes, so its gradient flows into the source's. The sender
checks at every step that it still is one, and refuses in one line where it is not.

[Note: wires at other sizes] PipelineStage receives into buffers allocated from the wires'
shapes, so a pipeline built on one sequence length would only run that one. :func:`infer_wires`
therefore also runs the chain once at symbolic input sizes ([Note: symbolic sizes] in
executor/ranks/symbolic.py) and keeps each tensor wire's shape as formulas over the inputs'
sizes (tensors are sent contiguous, so the shape gives the stride); :meth:`Wire.at` evaluates
them for the micro-batch at hand. Input dimensions the chain fixes stay numbers, and :func:`check_sizes` refuses other values for them in one line.
Where the symbolic run is not possible the formulas are None and only the example's sizes run.

[Note: wires under autocast] A tensor wire's dtype is what the probe run produced, so a
pipeline with ``precision="bf16"`` probes under that autocast (:func:`infer_wires`'s
``precision``) and its activations cross in bf16, as the plain model under autocast keeps
them. A step may still run under other autocast than the probe did (the caller's own ``with
torch.autocast(...)``, a probe on the meta device, where autocast does not act, or a CUDA op
list that differs from the CPU one the probe ran): a floating tensor whose dtype differs from
its wire's is cast to it before it is sent (and its gradient back on the way home). That
cast is exact from bf16 / fp16 to fp32, so the next stage computes what it would have, up to
ops that run in their input's dtype (an activation function on bf16 then runs on fp32).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from executor._torch_compat import TreeSpec, tree_flatten, tree_unflatten
from executor.errors import DistributedError
from executor.microbatch import Batch
from executor.precision import precision_autocast
from executor.ranks.messages import Slot, layout, message_metas, pack, unpack
from executor.ranks.split_backward import WeightGrads, split_backward, split_call
from executor.ranks.symbolic import SymbolicRun, evaluate, symbolic_run
from executor.ranks.tensor_parallel import token_share
from executor.recompute import Checkpointing

__all__ = ["Wire", "WireStage", "infer_wires", "wire_metas", "cut_metas", "slots", "Sizes", "input_sizes",
           "check_sizes"]

Sizes = tuple[tuple[int, ...] | None, ...]  # each model input's shape (None: not a tensor)


@dataclass(frozen=True)
class Wire:
    """How one value live at a cut crosses ranks: ``tensor``, ``scalar``, ``ints``, ``view`` (of
    the cut's tensor ``value``, not sent: [Note: a view crosses once]) or ``const``.

    ``shape``/``stride``/``dtype``/``requires_grad`` describe the tensor on the wire (at the
    example micro-batch): PipelineStage gets them up front and skips its metadata inference.
    """

    kind: str
    pytype: type | None = None  # int / float / bool for scalars; tuple / list / Size for ints
    value: Any = None  # the constant, for kind == "const"; the source's index, for "view"
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    requires_grad: bool = False
    # the shape as formulas of the input sizes ([Note: wires at other sizes]), or None
    shape_formula: tuple[Any, ...] | None = None
    parts: int = 1  # >1: each of a TP group's ranks sends 1/parts of the tokens (dim -2) of the formulas'

    @staticmethod
    def of(value: Any) -> Wire:
        if isinstance(value, Tensor):
            return Wire("tensor", None, None, tuple(value.shape), _contiguous(value.shape), value.dtype,
                        value.requires_grad)
        if isinstance(value, (bool, int, float)):
            return Wire("scalar", type(value), dtype=torch.float64 if isinstance(value, float) else torch.int64)
        if isinstance(value, (tuple, list)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            return Wire("ints", type(value), shape=(len(value),), stride=(1,))
        return Wire("const", None, value)

    def at(self, sizes: Sizes) -> Wire:
        """This wire for model inputs of ``sizes`` (itself when it has no formulas)."""
        if self.shape_formula is None:
            return self
        shape = token_share(tuple(evaluate(f, sizes) for f in self.shape_formula), self.parts)
        return replace(self, shape=shape, stride=_contiguous(shape))

    def split_tokens(self, parts: int) -> Wire:  # carrying 1/parts of its tokens (sequence parallelism)
        shape = token_share(self.shape, parts)
        return replace(self, shape=shape, stride=_contiguous(shape), parts=parts)

    def meta(self) -> Tensor | None:
        """An example of the tensor on the wire (meta device), or None for a constant."""
        if self.kind == "const":
            return None
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what is sent: see ``_encode``)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def wire_metas(wires: Sequence[Wire]) -> tuple[Tensor, ...]:
    """Every sent value's example tensor, as the model gives them (the inputs) or the loss takes
    them (the outputs)."""
    return tuple(t for t in (w.meta() for w in wires) if t is not None)


def slots(wires: Sequence[Wire]) -> tuple[Slot, ...]:
    """The sent values of a cut, as [Note: few messages per cut] packs them."""
    return tuple(Slot(tuple(int(n) for n in w.shape), w.dtype, w.requires_grad) for w in wires
                 if w.kind not in ("const", "view"))


def cut_metas(wires: Sequence[Wire]) -> tuple[Tensor, ...]:
    """The messages of a cut between two ranks ([Note: few messages per cut])."""
    return message_metas(slots(wires))


def _encode(values: Sequence[Any], wires: Sequence[Wire], device: torch.device) -> tuple[Tensor, ...]:
    if len(values) != len(wires):
        raise DistributedError(f"a stage returned {len(values)} values but its cut carries {len(wires)}; "
                               "rebuild the pipeline from the same model and plan on every rank")
    out: list[Tensor] = []
    for k, (value, wire) in enumerate(zip(values, wires, strict=True)):
        if wire.kind == "view":
            if not _reshapes(value, values[wire.value]):
                raise DistributedError(
                    f"cut value {k} was a view of value {wire.value} when the pipeline was built, and is "
                    "sent once as it ([Note: a view crosses once]), but it is not one now; make the model "
                    "return the same values at every step, or build the pipeline on inputs like these")
        elif wire.kind == "tensor":
            if value.dtype != wire.dtype and value.is_floating_point() and wire.dtype.is_floating_point:
                value = value.to(wire.dtype)  # [Note: wires under autocast]
            out.append(value.contiguous())  # what gloo and NCCL send; the buffers match it
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


def _reshapes(value: Any, source: Any) -> bool:
    """Whether tensor ``value`` is ``source`` reshaped: the same memory, both contiguous."""
    return (isinstance(value, Tensor) and isinstance(source, Tensor) and value.is_contiguous()
            and source.is_contiguous() and value.dtype == source.dtype and value.numel() == source.numel()
            and value.data_ptr() == source.data_ptr())


def with_views(cut: Sequence[Wire], values: Sequence[Any]) -> tuple[Wire, ...]:
    """``cut``'s wires with each tensor that reshapes an earlier one (``values``: the probe's)
    sent as a view of it ([Note: a view crosses once])."""
    out = list(cut)
    for k, (wire, value) in enumerate(zip(cut, values, strict=True)):
        source = next((j for j in range(k) if out[j].kind == "tensor" and _reshapes(value, values[j])), None)
        if wire.kind == "tensor" and source is not None:
            out[k] = replace(wire, kind="view", value=source)
    return tuple(out)


def _decode(tensors: Sequence[Tensor], wires: Sequence[Wire]) -> tuple[Any, ...]:
    it: Iterator[Tensor] = iter(tensors)
    out: list[Any] = []
    for wire in wires:
        if wire.kind == "view":
            out.append(out[wire.value].view(wire.shape))  # its source comes first
        elif wire.kind == "tensor":
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
    """A probe run that leaves no trace: buffers (BatchNorm statistics) and the RNG of every
    device the stages use restored afterwards. The stages keep their mode: a graph that holds
    one mode only refuses the other, so it is probed in the mode it is in."""
    buffers = [(b, b.detach().clone()) for s in stages for b in s.buffers()]
    cuda = sorted({int(t.device.index or 0) for s in stages for t in [*s.parameters(), *s.buffers()]
                   if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def infer_wires(stages: Sequence[nn.Module], example_inputs: tuple[Any, ...],
                precision: str = "fp32") -> list[tuple[Wire, ...]]:
    """The wires of every cut from one probe run of the chain (with autograd, so that
    ``requires_grad`` is known): cut 0 is the model's inputs, cut ``i`` stage ``i``'s inputs,
    and the extra last cut the tensor leaves of the model's output (what the loss receives).
    Tensor wires carry formulas for other input sizes where a symbolic run of the chain is
    possible ([Note: wires at other sizes]). Each stage runs under ``precision``'s autocast,
    as the pipeline will run it ([Note: wires under autocast])."""
    bad = [k for k, v in enumerate(example_inputs) if not isinstance(v, Tensor)]
    if bad:
        raise DistributedError(
            f"model inputs {bad} are not tensors; torch.distributed.pipelining feeds the first "
            "stage tensors only: pass non-tensor arguments as constants of the model instead"
        )
    device = next((x.device for x in example_inputs if x.device.type in ("cpu", "cuda")),
                  torch.device("cpu"))
    with _probing(stages):
        cuts = _chain(stages, tuple(example_inputs), precision, device)
        wires = [tuple(Wire.of(v) for v in values) for values in cuts]
        wires = [cut if i in (0, len(cuts) - 1) else with_views(cut, values)  # between ranks only
                 for i, (cut, values) in enumerate(zip(wires, cuts, strict=True))]
        try:
            run = symbolic_run(lambda *xs: _chain(stages, xs, precision, device), example_inputs)
            return [tuple(_with_formulas(w, v, run) for w, v in zip(cut, values, strict=True))
                    for cut, values in zip(wires, run.outputs, strict=True)]
        except Exception:  # noqa: BLE001 - no formulas: the example's sizes only
            return wires


def _chain(stages: Sequence[nn.Module], inputs: tuple[Any, ...], precision: str = "fp32",
           device: torch.device | None = None) -> list[tuple[Any, ...]]:
    """The values at every cut of one run of the chain (see :func:`infer_wires`)."""
    cuts: list[tuple[Any, ...]] = []
    values: tuple[Any, ...] = inputs
    for i, stage in enumerate(stages):
        cuts.append(values)
        with precision_autocast(precision, device or torch.device("cpu")):
            out = stage(*values)
        values = _as_tuple(out) if i < len(stages) - 1 else tuple(tree_flatten(out)[0])
    cuts.append(tuple(v for v in values if isinstance(v, Tensor)))
    return cuts


def _with_formulas(wire: Wire, value: Any, run: SymbolicRun) -> Wire:
    if wire.kind not in ("tensor", "view") or not isinstance(value, Tensor):
        return wire
    return replace(wire, shape_formula=tuple(run.formula(n) for n in value.shape))


def input_sizes(inputs: Sequence[Any]) -> Sizes:
    """The sizes :meth:`Wire.at` takes: each input's shape (None for a non-tensor)."""
    return tuple(tuple(int(n) for n in x.shape) if isinstance(x, Tensor) else None for x in inputs)


def check_sizes(inputs: Sequence[Wire], sizes: Sizes, names: Sequence[str] = ()) -> str:
    """"" when the chain runs inputs of ``sizes`` (cut 0's wires: ``inputs``, named ``names``
    where known), else one line naming the first input dimension the chain fixes otherwise."""
    for i, (wire, shape) in enumerate(zip(inputs, sizes, strict=False)):
        if wire.kind != "tensor" or shape is None:
            continue
        name = f"input '{names[i]}'" if i < len(names) else f"model input {i}"
        if len(shape) != len(wire.shape):
            return (f"{name} has {len(shape)} dimensions but the pipeline was built for "
                    f"{len(wire.shape)} ({list(wire.shape)}); pass inputs shaped like the example")
        fixed = wire.shape_formula or wire.shape
        for d, (want, got) in enumerate(zip(fixed, shape, strict=True)):
            if isinstance(want, int) and want != got:
                how = ("its stages fix it" if wire.shape_formula is not None else
                       "it was built for the example's sizes only (no symbolic run of its stages)")
                if want < 2 and wire.shape_formula is not None:
                    how = "it was built with that size (torch fixes sizes 0 and 1): build with >= 2"
                return (f"dimension {d} of {name} is {got}, but the pipeline runs {want} there: "
                        f"{how}; pass inputs with {want} in dimension {d}")
    return ""


class WireStage(nn.Module):
    """One stage as PipelineStage sees it: messages in, messages out.

    ``first`` and ``last`` mark the first and last stage: the first takes the model's inputs
    as they are, the last flattens its output pytree to tensor leaves and :meth:`unflatten`
    rebuilds it for the loss; between ranks, each cut's values travel packed ([Note: few
    messages per cut]) at the input sizes :meth:`use` sets. ``recompute`` is set per
    micro-batch by the pipeline (see [Note: distributed recomputation]). Every call runs under
    ``precision``'s autocast on ``device`` ([Note: mixed precision] in executor/precision.py),
    inside the caller's; a recomputation replays the autocast its forward ran under. ``split``
    (the zero-bubble schedules) runs each training call as one node whose backward gives the
    input gradients first and queues the weight gradients on :attr:`weight_grads`
    ([Note: split backward on ranks] in executor/ranks/split_backward.py).
    """

    def __init__(
        self, stage: nn.Module, inputs: Sequence[Wire], outputs: Sequence[Wire], *, first: bool,
        last: bool, device: torch.device, precision: str = "fp32", split: bool = False,
    ) -> None:
        super().__init__()
        self.stage, self.precision, self.device = stage, precision, device
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.first, self.last, self.recompute = first, last, False
        self.weight_grads = WeightGrads(lambda: self.stage.parameters()) if split else None
        self._spec: TreeSpec | None = None
        self._consts: list[tuple[int, Any]] = []
        self._sizes: Sizes | None = None
        self._size_cuts(self.inputs, self.outputs)  # at the example's sizes

    def use(self, sizes: Sizes) -> None:
        """Pack and unpack the cuts as they are for model inputs of ``sizes``."""
        if sizes != self._sizes:
            self._size_cuts([w.at(sizes) for w in self.inputs], [w.at(sizes) for w in self.outputs])
            self._sizes = sizes

    def _size_cuts(self, inputs: Sequence[Wire], outputs: Sequence[Wire]) -> None:
        self._sized_inputs = tuple(inputs)  # a view's shape at these sizes ([Note: a view crosses once])
        self._in, self._out = slots(inputs), slots(outputs)
        # under recomputation or a split backward, which output messages get a gradient back (run plainly)
        self._needs = [m.kind == "cat" or (m.kind == "alone" and self._out[m.members[0]].requires_grad)
                       for m in layout(self._out)]

    def forward(self, *received: Tensor) -> tuple[Tensor, ...]:
        with precision_autocast(self.precision, self.device):
            return self._forward(*received)

    def _forward(self, *received: Tensor) -> tuple[Tensor, ...]:
        training = self.stage.training and torch.is_grad_enabled()
        weights = self.weight_grads
        if self.recompute and training:
            # [Note: distributed recomputation]: executor.GPipe's checkpoint, recomputing when
            # the gradient arrives (no side lane: nothing to overlap it with here)
            split = None if weights is None else lambda ys, gs, xs: split_backward(ys, gs, xs, weights)
            chk = Checkpointing(lambda batch: batch.call(self._run), Batch(received), self.device, split=split)
            out = tuple(chk.checkpoint().tensors())
        elif weights is not None and training:
            out = split_call(self._run, received, self.device, weights)
        else:
            return self._run(*received)
        if self.last:
            return out
        # every float output of either node needs a gradient; the next stage sends one only
        # for those that needed it run plainly (torch's backward wants one for each)
        return tuple(t if g else t.detach() for t, g in zip(out, self._needs, strict=True))

    def _run(self, *received: Tensor) -> tuple[Tensor, ...]:
        wire = received if self.first else unpack(received, self._in)
        out = self.stage(*_decode(wire, self._sized_inputs))
        if not self.last:
            return pack(_encode(_as_tuple(out), self.outputs, self.device), self._out)
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


