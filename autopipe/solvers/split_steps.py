"""Many contiguous splits' steps at once: a lower bound on each one's simulated iteration.

    steps = SplitSteps.of(costs, devices, options)        # None where it does not apply
    lows = steps(cuts)                                    # cuts: (splits, stages - 1) first layers

[Note: steps in a batch] The simulator (autopipe.core.simulator) runs each device's operations in
the order its schedule fixes; where every device has a queue of its own (one stage per device,
or a multi-stage schedule's ranks) an operation starts when the one before it on its device has
ended and its input is ready, so the iteration is the longest path through a graph of the
operations that is the same for every split of one configuration: only the operations'
durations depend on where the cuts fall. ``SplitSteps`` walks that graph once per merge rule
(``program``, in an order where each operation follows the ones it waits for) with every
duration a numpy column over the splits, so thousands of splits cost about one simulation.

Each duration is the cost model's own (autopipe.core.cost's ``split_parts``,
``split_backward_ms``, ``recompute_ms``; the crossings of autopipe.core.transfer over
``LayerCosts.cut_bytes``), summed over the stage's layers from prefix sums. Left out, because
they only lengthen the step: the data-parallel collectives and gathers. So the result is a
lower bound on the simulated iteration of each split under every merge rule the schedule has
(the least of the rules'), and equal to it, up to rounding, for one replica: the step's search
([Note: the step, not the bottleneck] in step_split.py) ranks splits by it and simulates only
those it cannot rule out. A contiguous split of the topological order (all the step's search
makes) sends at each cut what ``LayerCosts.cut_bytes`` has there, skips included. Not covered
(``of`` returns None): stages that share a device outside a multi-stage schedule (the simulator
then picks among ready operations as it goes), and layers recomputed alone (their stage's
backward changes shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    crossing_ms,
    receive_ms,
    recompute_ms,
    split_backward_ms,
    split_parts,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.simulator import operation_queues
from executor.spec import (
    MULTI_STAGE_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    is_recomputed,
    merge_rules,
    recomputed_microbatches,
)

__all__ = ["SplitSteps", "program"]

# One operation: the operation before it on its device (-1: none), the one whose end makes it
# ready (-1: none) and whether that end is before its send, the durations added before its own
# ((row, stage): receiving, recomputing), its own, and its send (or None); then the operations
# whose ends it is the last to read. Ends are kept as an operation's own end and its end after
# its send.
Step = tuple[int, int, bool, tuple[tuple[str, int], ...], tuple[str, int], tuple[str, int] | None, tuple[int, ...]]


@lru_cache(maxsize=256)
def program(schedule: str, names: tuple[str, ...], chunks: int, merge: str,
            recomputed: tuple[int, ...]) -> tuple[tuple[Step, ...], tuple[int, ...]] | None:
    """The operations of one configuration in an order where each follows what it waits for (the
    simulator's rules of readiness and durations, autopipe.core.simulator's ``execute``, less the
    collectives), and each device's last operation; None where stages share a device outside a
    multi-stage schedule."""
    queues, resource, device_of = operation_queues(schedule, list(names), chunks, merge)
    if len(set(resource)) != len(resource):
        return None
    k, m = len(names), chunks
    local = [schedule in MULTI_STAGE_SCHEDULES and device_of[s] == device_of[s + 1] for s in range(k - 1)]
    made: dict[tuple[str, int, int], tuple[int, bool]] = {}  # what is ready: by which operation, before its send
    last: dict[int, int] = {}
    pos = [0] * len(queues)
    out: list[tuple[int, int, bool, tuple[tuple[str, int], ...], tuple[str, int], tuple[str, int] | None]] = []
    reads: list[list[tuple[int, bool]]] = []
    progress = True
    while progress:
        progress = False
        for q, queue in enumerate(queues):
            while pos[q] < len(queue):
                s, kind, i = queue[pos[q]]
                key = ("B" if kind == "I" else kind, s, i)
                if key not in made and not (kind == "F" and s == 0):
                    break
                dep, main = made.pop(key, (-1, False))
                before: list[tuple[str, int]] = []
                send: tuple[str, int] | None = None
                j = len(out)
                if kind == "F":
                    if s > 0 and not local[s - 1]:
                        before.append(("receive in", s))
                    if s == k - 1:
                        made["B", s, i] = (j, False)
                    else:
                        send = None if local[s] else ("send out", s)
                        made["F", s + 1, i] = (j, False)
                elif kind != "W":
                    if s < k - 1 and not local[s]:
                        before.append(("receive out", s))
                    if is_recomputed(i, m, recomputed[s]):
                        before.append(("recompute", s))
                    if kind == "I":
                        made["W", s, i] = (j, True)
                    if s > 0:
                        send = None if local[s - 1] else ("send in", s)
                        made["B", s - 1, i] = (j, False)
                prev = last.get(resource[q], -1)
                reads.append([(prev, False)] * (prev >= 0) + [(dep, main)] * (dep >= 0))
                out.append((prev, dep, main, tuple(before), (kind, s), send))
                last[resource[q]] = j
                pos[q] += 1
                progress = True
    if any(p < len(queue) for p, queue in zip(pos, queues, strict=True)):  # pragma: no cover - a bug
        raise RuntimeError("schedule deadlocked")
    finals = set(last.values())
    last_read: dict[int, int] = {}  # each end's last reader, so a walk lets it go there
    for j, rs in enumerate(reads):
        for op, _ in rs:
            last_read[op] = j
    drops: list[list[int]] = [[] for _ in out]
    for op, j in last_read.items():
        if op not in finals:
            drops[j].append(op)
    return tuple((*step, tuple(drop)) for step, drop in zip(out, drops, strict=True)), tuple(sorted(finals))


@dataclass(frozen=True)
class SplitSteps:
    """A configuration's costs as prefix sums, and its programs: :meth:`__call__` gives a lower
    bound on the simulated iteration of each contiguous split ([Note: steps in a batch])."""

    costs: LayerCosts
    devices: tuple[DeviceSpec, ...]
    options: CostOptions
    programs: tuple[tuple[tuple[Step, ...], tuple[int, ...]], ...]

    @classmethod
    def of(cls, costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> SplitSteps | None:
        """The batch of ``options``' configuration on ``devices``, or None where it does not apply."""
        if options.recompute_layers:
            return None
        names = tuple(d.name for d in devices)
        recomputed = tuple(recomputed_microbatches(mode, options.chunks) for mode in options.modes(len(devices)))
        programs = [program(options.schedule, names, options.chunks, rule, recomputed)
                    for rule in merge_rules(options.schedule)]
        if any(p is None for p in programs):
            return None
        return cls(costs, tuple(devices), options, tuple(p for p in programs if p is not None))

    @property
    def exact(self) -> bool:
        """Whether the bound is the simulated step itself (up to rounding): one replica, so no
        collectives were left out."""
        return self.options.data_parallel == 1

    @property
    def operations(self) -> int:
        """Operations walked per split (what one call costs, per split)."""
        return sum(len(p) for p, _ in self.programs)

    def __call__(self, cuts: np.ndarray) -> np.ndarray:
        """(splits,): for each row of ``cuts`` (the first layer of every stage after the first,
        increasing), a lower bound on its simulated iteration (ms), under the best merge rule."""
        cuts = np.asarray(cuts, dtype=np.int64).reshape(-1, len(self.devices) - 1)
        parts = self._durations(cuts)
        return np.min([_walk(steps, finals, parts) for steps, finals in self.programs], axis=0)

    def _durations(self, cuts: np.ndarray) -> dict[str, np.ndarray]:
        """Each stage's operation durations, (stages, splits), as autopipe.core.cost has them."""
        c, o, k, n = self.costs, self.options, len(self.devices), len(self.costs)
        edges = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), n)], axis=1).T
        speed = np.array([d.speed for d in self.devices])[:, None]

        def summed(values: np.ndarray) -> np.ndarray:
            prefix = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
            return (prefix[edges[1:]] - prefix[edges[:-1]]) / speed

        fwd, bwd = summed(c.fwd), summed(c.bwd)
        cut = c.cut_bytes().astype(np.float64)
        inputs = np.where(np.arange(k)[:, None] > 0, cut[edges[:-1]], 0.0)
        outputs = np.where(np.arange(k)[:, None] < k - 1, cut[edges[1:]], 0.0)
        call_fwd, call_bwd = c.call_for(o.schedule)
        mpb = o.ms_per_byte
        out = {"F": fwd + call_fwd, "B": bwd + call_bwd,
               "recompute": recompute_ms(fwd, 1, 1, c.recompute_ratio, c.recompute_call_ms),
               "send in": crossing_ms(inputs, mpb, c.comm_latency_ms if mpb else 0.0),
               "send out": crossing_ms(outputs, mpb, c.comm_latency_ms if mpb else 0.0),
               "receive in": receive_ms(inputs, mpb, c.comm_receive_share),
               "receive out": receive_ms(outputs, mpb, c.comm_receive_share)}
        if o.schedule in ZERO_BUBBLE_SCHEDULES and c.bwd_input is not None:
            halves = []
            for s, (i, b) in enumerate(zip(summed(c.bwd_input), bwd, strict=True)):
                first, rest = split_parts(i, b, c.split_ratio, first=s == 0, whole=False)
                halves.append(split_backward_ms(b, first, call_bwd, rest))
            out["I"] = np.array([np.broadcast_to(i, bwd.shape[1]) for i, _ in halves])
            out["W"] = np.array([np.broadcast_to(w, bwd.shape[1]) for _, w in halves])
        return {key: np.broadcast_to(value, fwd.shape) for key, value in out.items()}  # a formula's 0.0 too



def _walk(steps: tuple[Step, ...], finals: tuple[int, ...], durations: dict[str, np.ndarray]) -> np.ndarray:
    """The simulator's clock over a program with every duration a column: the step's end."""
    rows = {key: list(value) for key, value in durations.items()}  # a row per stage
    zero = np.zeros(durations["F"].shape[1])
    own: list[Any] = []  # each operation's end, and after its send (None once read for the last time)
    sent: list[Any] = []
    for prev, dep, main, before, (kind, s), send, drop in steps:
        start = sent[prev] if prev >= 0 else zero
        if dep >= 0:
            start = np.maximum(start, own[dep] if main else sent[dep])
        for key, t in before:
            start = start + rows[key][t]
        end = start + rows[kind][s]
        own.append(end)
        sent.append(end if send is None else end + rows[send[0]][send[1]])
        for j in drop:
            own[j] = sent[j] = None
    return np.max([sent[j] for j in finals], axis=0)
