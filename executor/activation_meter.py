"""Each stage's activation memory, counted exactly: the bytes autograd keeps for backward.

    meter = ActivationMeter(pipe.stages, inputs=(x,))
    with meter:
        out = pipe(x)
        with meter.outside():
            loss = loss_fn(out, y)
        loss.backward()
    meter.peaks            # bytes per stage: the most it held at once
    meter.input_saves      # bytes per stage: the most of its own input one call saved

[Note: counting activations] On a CPU there is no allocator to ask (``RssAnon`` counts the
whole process, and freed pages are reused or not at the allocator's whim), so the activations
a pipeline holds are counted where autograd keeps them: every tensor saved for backward passes
through ``torch.autograd.graph.saved_tensors_hooks``. The pack hook charges the tensor's
storage to the stage that ran last (a forward pre-hook on each stage module, which also covers
executor.recompute's recomputation and the stage inputs its Checkpoint nodes save just after
the stage's call, and on each module of only one stage, which covers a part of a stage
recomputed in the backward); code between the pipeline and its backward, the loss, runs under
:meth:`ActivationMeter.outside`, which counts nothing and returns a small holder; autograd drops the holder
when it frees the saved tensor (after that node's backward), and the holder gives the bytes
back. A storage saved several times by one stage (a ReLU's output read by the next Linear) is
counted once; parameters and buffers are state, not activations, and are never counted, nor
is the caller's batch (``inputs``) that a checkpointed first stage keeps a view of. What
the count leaves out is what is not saved for backward: a micro-batch's output on its way to
the next stage and gradients in flight. ``input_saves`` is, per stage, the most bytes of its own
input (what it received) that one call saved: a recomputed micro-batch holds that input once,
as what it kept and what its layers save again, where the cost model counts both ([Note: stage
memory] in autopipe/core/stage_memory.py). On CUDA, ``torch.cuda.max_memory_allocated`` measures
everything instead; this meter is the CPU's exact view of the part the cost model predicts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationMeter"]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage
        return id(t), int(t.numel()) * t.element_size()


class _Held:
    """A saved tensor charged to a stage; gives its bytes back when autograd frees it."""

    __slots__ = ("tensor", "meter", "stage", "key")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, stage: int, key: int) -> None:
        self.tensor, self.meter, self.stage, self.key = tensor, meter, stage, key

    def __del__(self) -> None:
        self.meter._release(self.stage, self.key)


class ActivationMeter:
    """Live and peak bytes saved for backward, per stage ([Note: counting activations])."""

    def __init__(self, stages: Sequence[nn.Module], inputs: Sequence[Any] = ()) -> None:
        """``inputs``: the pipeline's input tensors, which a checkpointed first stage saves
        (views of the caller's batch): not activations, so not counted."""
        self.stages = list(stages)
        self.peaks = [0] * len(self.stages)
        self.live = [0] * len(self.stages)
        self.input_saves = [0] * len(self.stages)
        self._inputs: list[dict[int, int]] = [{} for _ in self.stages]  # this call's input: bytes
        self._saved_inputs: list[set[int]] = [set() for _ in self.stages]  # of them, those it saved
        self._refs: list[dict[int, list[int]]] = [{} for _ in self.stages]  # key -> [count, bytes]
        self._state = {_storage(t)[0] for s in self.stages
                       for t in (*s.parameters(), *s.buffers())}
        self._state |= {_storage(t)[0] for t in inputs if isinstance(t, torch.Tensor)}
        self._current: int | None = None
        self._handles: list[Any] = []
        self._hooks: Any = None

    def _enter_stage(self, index: int | None) -> None:
        self._current = index

    def _call_stage(self, index: int, args: Any) -> None:
        self._current = index
        self._inputs[index] = dict(_storage(t) for t in args if isinstance(t, torch.Tensor))
        self._saved_inputs[index] = set()

    @contextmanager
    def outside(self) -> Iterator[None]:
        """Count nothing that is saved in this block (the loss after the last stage)."""
        before, self._current = self._current, None
        try:
            yield
        finally:
            self._current = before

    def _pack(self, t: torch.Tensor) -> Any:
        key, nbytes = _storage(t)
        s = self._current
        if s is None or key in self._state:
            return t
        inputs, saved = self._inputs[s], self._saved_inputs[s]
        if key in inputs and key not in saved:
            saved.add(key)
            self.input_saves[s] = max(self.input_saves[s], sum(inputs[k] for k in saved))
        ref = self._refs[s].setdefault(key, [0, nbytes])
        ref[0] += 1
        if ref[0] == 1:
            self.live[s] += nbytes
            self.peaks[s] = max(self.peaks[s], self.live[s])
        return _Held(t, self, s, key)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, stage: int, key: int) -> None:
        ref = self._refs[stage].get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live[stage] -= ref[1]
            del self._refs[stage][key]

    def __enter__(self) -> ActivationMeter:
        owners: dict[int, set[int]] = {}
        for i, stage in enumerate(self.stages):
            for m in stage.modules():
                owners.setdefault(id(m), set()).add(i)
        for i, stage in enumerate(self.stages):
            # every module of one stage only, not just the stage: a part of it recomputed in the
            # backward (a checkpointed segment) saves for this stage while another ran last
            self._handles.append(stage.register_forward_pre_hook(lambda _m, a, i=i: self._call_stage(i, a)))
            # what saves the input after the call (a Checkpoint node) is not one of its layers
            self._handles.append(stage.register_forward_hook(lambda _m, _a, _o, i=i: self._inputs[i].clear()))
            for m in stage.modules():
                if m is not stage and owners[id(m)] == {i}:
                    self._handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: self._enter_stage(i)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, err, tb)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._current = None
