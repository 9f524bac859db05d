"""A distributed pipeline at any input size: one set of PipelineStages and a schedule per size.

[Note: one schedule per input size] A PipelineStage allocates its receive buffers from the
static shapes it is given, so the stages and schedule built for the example micro-batch run
that size only. :class:`SizedSchedules` builds them again for each input size a pipeline meets,
from the wires at that size ([Note: wires at other sizes] in executor/ranks/wire.py), and keeps the
last few (their buffers cost memory). Which size a step has is decided by the pipeline's rank 0
(group rank 0 of a mesh's pp group), which holds stage 0 and so is the one rank that must be
given the inputs, and broadcast on the pipeline's group before the step (one small int64
tensor): every rank then picks or builds the same schedule, or refuses the inputs with the same
one-line error, instead of one rank raising while its peers wait for it until the timeout.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from executor._torch_compat import CompatStage, without_self_sends
from executor.errors import DistributedError
from executor.ranks.wire import Sizes, Wire, WireStage, check_sizes, cut_metas, wire_metas
from executor.spec import is_recomputed

__all__ = ["SizedSchedules", "microbatch_sizes_of"]

_KEEP = 4  # sizes whose stages and schedule are kept


class _Stage(CompatStage):
    """PipelineStage that tells its WireStage which micro-batches to recompute (and runs on torch
    2.11 as on 2.13: [Note: integers across a cut]). ``submodule`` is
    the WireStage itself, or the DistributedDataParallel wrapping it (executor/ranks/replicated.py);
    under the zero-bubble schedules ``dw_builder`` runs the weight gradients its WireStage
    queued ([Note: split backward on ranks] in executor/ranks/split_backward.py)."""

    def __init__(self, submodule: torch.nn.Module, wire: WireStage, recomputed: tuple[int, int],
                 *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        self._wire, self._recomputed = wire, recomputed  # (R, M)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        wire = self._wire
        r, m = self._recomputed
        wire.recompute = is_recomputed(fwd_chunk_id, m, r)  # [Note: which micro-batches recompute]
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            wire.recompute = False

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        """A whole backward (``full_backward``: torch's B, [Note: adjacent I and W] in
        executor/spec.py) is run whole by the split stage, not as its halves one after the other."""
        grads = self._wire.weight_grads
        if grads is not None:
            grads.whole = full_backward
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)
        finally:
            if grads is not None:
                grads.whole = False

    # Forward only (eval_step), torch 2.11 to 2.15's V schedules still run their backward
    # actions, each a no-op but for the hand-over of the gradients to the previous stage on the
    # same rank, which refuses a stage without backward: nothing to hand over then.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:  # torch 2.11, 2.12: see without_self_sends
        return without_self_sends(super()._get_init_p2p_neighbors_ops(), self.group_rank)


def microbatch_sizes_of(inputs: Sequence[Any], chunks: int) -> Sizes:
    """The sizes of one micro-batch of ``inputs`` (batch divisible by ``chunks``)."""
    return tuple(
        ((int(x.shape[0]) // chunks, *map(int, x.shape[1:])) if x.dim() else ())
        if isinstance(x, Tensor) else None
        for x in inputs
    )


def _input_names(stage: torch.nn.Module) -> list[str]:
    """The names of stage 0's parameters (a traced stage's are the model's inputs), or []."""
    try:
        parameters = inspect.signature(stage.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


class SizedSchedules:
    """This rank's schedule for each input size (see [Note: one schedule per input size])."""

    def __init__(
        self,
        wire_stages: Sequence[WireStage],
        indices: Sequence[int],
        num_stages: int,
        wires: Sequence[Sequence[Wire]],
        make_schedule: Callable[[list[_Stage]], Any],
        *,
        recomputed: Sequence[int],  # per wire stage: how many of the ``chunks`` it recomputes
        chunks: int,
        device: torch.device,
        group: dist.ProcessGroup,
        modules: Sequence[torch.nn.Module] | None = None,  # what PipelineStage runs: the wire
    ) -> None:                                              # stages, or their DDP wrappers
        self.wire_stages, self.indices, self.num_stages = list(wire_stages), list(indices), num_stages
        self.modules = list(modules) if modules is not None else list(wire_stages)
        self.wires = [tuple(cut) for cut in wires]
        self.make_schedule, self.recomputed, self.device, self.group = make_schedule, list(recomputed), device, group
        self.chunks = chunks
        self.example: Sizes = tuple(tuple(w.shape) if w.kind == "tensor" else None for w in self.wires[0])
        self._built: OrderedDict[Sizes, tuple[list[_Stage], Any]] = OrderedDict()
        self._names = _input_names(self.wire_stages[0].stage)
        self._sent: tuple[Any, Tensor] | None = None  # rank 0's last broadcast, not waited for
        self.get(self.example)

    def get(self, sizes: Sizes) -> Any:
        """The schedule for micro-batches of ``sizes``, built on first use; the wire stages
        pack their cuts for those sizes ([Note: few messages per cut])."""
        try:  # this rank's own cuts first, then every cut: either may not take these sizes
            for w in self.wire_stages:
                w.use(sizes)
            if sizes in self._built:
                self._built.move_to_end(sizes)
                return self._built[sizes][1]
            at = [tuple(w.at(sizes) for w in cut) for cut in self.wires]
        except DistributedError:
            raise  # its own line (sequence parallelism's tokens)
        except ValueError as err:
            raise DistributedError(f"cannot size the pipeline's cuts for inputs {list(sizes)}: {err}; "
                                   "pass inputs shaped like the example") from None
        last = self.num_stages - 1
        stages = [  # static metadata: no inference run on the first step
            _Stage(m, w, (r, self.chunks), i, self.num_stages, self.device,
                   input_args=wire_metas(at[i]) if i == 0 else cut_metas(at[i]),
                   output_args=wire_metas(at[i + 1]) if i == last else cut_metas(at[i + 1]), group=self.group,
                   dw_builder=None if w.weight_grads is None else w.weight_grads.builder)
            for m, w, r, i in zip(self.modules, self.wire_stages, self.recomputed, self.indices, strict=True)
        ]
        schedule = self.make_schedule(stages)
        self._built[sizes] = (stages, schedule)
        while len(self._built) > _KEEP:
            self._built.popitem(last=False)
        return schedule

    def agree(self, sizes: Sizes | None, problem: str) -> Sizes:
        """Rank 0's micro-batch ``sizes`` on every rank, or DistributedError on every rank when
        rank 0 found a ``problem`` with its inputs (it raises that; the others say so)."""
        if not problem and sizes is not None:
            problem = check_sizes(self.wires[0], sizes, self._names)
        if dist.get_world_size(self.group) == 1:
            if problem or sizes is None:
                raise DistributedError(problem or "no inputs were given")
            return sizes
        spec = [len(w.shape) if w.kind == "tensor" else -1 for w in self.wires[0]]
        buffer = torch.zeros(1 + sum(max(n, 0) for n in spec), dtype=torch.int64, device=self.device)
        lead = dist.get_rank(self.group) == 0  # the pipeline's first rank (a mesh's pp group's)
        if lead:
            if problem or sizes is None:
                buffer[0] = 1
            elif buffer.numel() > 1:
                buffer[1:] = torch.tensor([n for shape in sizes if shape is not None for n in shape])
        if self._sent is not None:
            self._sent[0].wait()
            self._sent = None
        if lead and sizes is not None and not problem:  # it knows them: it sends and goes on,
            self._sent = (dist.broadcast(buffer, group=self.group, group_src=0, async_op=True), buffer)
            return sizes  # its first forward overlaps the broadcast (waited for next step)
        dist.broadcast(buffer, group=self.group, group_src=0)
        if int(buffer[0]):
            raise DistributedError(problem if lead else
                                   "rank 0 refused this step's inputs (its error says why); every "
                                   "rank stops the step")
        values = iter(int(v) for v in buffer[1:].tolist())
        return tuple(tuple(next(values) for _ in range(n)) if n >= 0 else None for n in spec)
