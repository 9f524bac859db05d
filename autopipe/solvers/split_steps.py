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

# (device, stage, kind, micro-batch) of each operation, each after those it waits for
Program = tuple[tuple[int, int, str, int], ...]


@lru_cache(maxsize=256)
def program(schedule: str, names: tuple[str, ...], chunks: int, merge: str) -> tuple[Program, tuple[bool, ...]] | None:
    """The operations of one configuration in an order where each follows what it waits for (the
    simulator's own rules of readiness), and whether each cut lies within one rank (no message);
    None where stages share a device outside a multi-stage schedule."""
    queues, resource, device_of = operation_queues(schedule, list(names), chunks, merge)
    if len(set(resource)) != len(resource):
        return None
    k = len(names)
    local = tuple(schedule in MULTI_STAGE_SCHEDULES and device_of[s] == device_of[s + 1] for s in range(k - 1))
    done: set[tuple[str, int, int]] = {("F", 0, i) for i in range(chunks)}
    pos, out = [0] * len(queues), []
    progress = True
    while progress:
        progress = False
        for q, queue in enumerate(queues):
            while pos[q] < len(queue):
                s, kind, i = queue[pos[q]]
                if ("B" if kind == "I" else kind, s, i) not in done:
                    break
                out.append((resource[q], s, kind, i))
                pos[q] += 1
                progress = True
                if kind == "F":
                    done.add(("B", s, i) if s == k - 1 else ("F", s + 1, i))
                else:
                    if kind == "I":
                        done.add(("W", s, i))
                    if kind != "W" and s > 0:
                        done.add(("B", s - 1, i))
    if any(p < len(queue) for p, queue in zip(pos, queues, strict=True)):  # pragma: no cover - a bug
        raise RuntimeError("schedule deadlocked")
    return tuple(out), local


@dataclass(frozen=True)
class SplitSteps:
    """A configuration's costs as prefix sums, and its programs: :meth:`__call__` gives a lower
    bound on the simulated iteration of each contiguous split ([Note: steps in a batch])."""

    costs: LayerCosts
    devices: tuple[DeviceSpec, ...]
    options: CostOptions
    programs: tuple[tuple[Program, tuple[bool, ...]], ...]

    @classmethod
    def of(cls, costs: LayerCosts, devices: Sequence[DeviceSpec], options: CostOptions) -> SplitSteps | None:
        """The batch of ``options``' configuration on ``devices``, or None where it does not apply."""
        if options.recompute_layers:
            return None
        names = tuple(d.name for d in devices)
        programs = [program(options.schedule, names, options.chunks, rule) for rule in merge_rules(options.schedule)]
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
        return np.min([self._walk(prog, local, parts) for prog, local in self.programs], axis=0)

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

    def _walk(self, prog: Program, local: tuple[bool, ...], d: dict[str, np.ndarray]) -> np.ndarray:
        """The simulator's clock over ``prog`` with every duration a column (autopipe.core.simulator's
        ``execute``, less the collectives)."""
        k, m = len(self.devices), self.options.chunks
        rec = [recomputed_microbatches(mode, m) for mode in self.options.modes(k)]
        zero = np.zeros(d["F"].shape[1])
        free: dict[int, np.ndarray] = {}
        ready: dict[tuple[str, int, int], np.ndarray] = {}
        for dev, s, kind, i in prog:
            at = free.get(dev, zero)
            if kind == "F":
                start = np.maximum(at, ready.pop(("F", s, i))) if s > 0 else at
                if s > 0 and not local[s - 1]:
                    start = start + d["receive in"][s]
                end = start + d["F"][s]
                if s == k - 1:
                    ready["B", s, i] = end
                elif local[s]:
                    ready["F", s + 1, i] = end
                else:
                    end = ready["F", s + 1, i] = end + d["send out"][s]
            elif kind == "W":
                end = np.maximum(at, ready.pop(("W", s, i))) + d["W"][s]
            else:
                start = np.maximum(at, ready.pop(("B", s, i)))
                if s < k - 1 and not local[s]:
                    start = start + d["receive out"][s]
                if is_recomputed(i, m, rec[s]):
                    start = start + d["recompute"][s]
                end = start + d[kind][s]
                if kind == "I":
                    ready["W", s, i] = end
                if s > 0 and local[s - 1]:
                    ready["B", s - 1, i] = end
                elif s > 0:
                    end = ready["B", s - 1, i] = end + d["send in"][s]
            free[dev] = end
        return np.max(list(free.values()), axis=0)

