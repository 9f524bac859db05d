"""Replicas of the pipeline: what data parallelism adds to a stage's time and memory.

[Note: pipeline x data parallel] ``data_parallel=D`` runs D replicas of one K-stage pipeline on
N = D x K devices (a DeviceMesh of D x K ranks; torchtitan, Megatron and DeepSpeed compose PP
with DP this way). Each replica trains ``batch_size / D`` rows of the GLOBAL batch in M
micro-batches of ``ceil(batch_size / D / M)`` rows; stage s of every replica holds the same
layers, and the D copies of a stage keep their parameters equal by a collective over those D
ranks. ``plan.batch_size`` is the global batch, ``plan.micro_batch_size`` one replica's
micro-batch; a Profile handed to ``Plan.from_stages`` describes one replica's micro-batch.
The replicas run at the same time, so the time per global batch is one replica's iteration,
collectives included: the planner's objective (autopipe/solvers/data_parallel_search.py).

Devices: the D x K devices are taken replica by replica (replica r runs stage s on device
``r x K + s`` of the list); a plan's ``devices`` are one stage's device each, replica 0's names,
with the least memory and speed of the D devices that run that stage (``replica_devices``).

Collectives, as ring algorithms over the plan's ``bandwidth`` (bytes/s per link; None or 0 =
free, as for transfers between stages), on a stage's parameter bytes P (tied ones included;
gradients have the parameters' dtype, so G = P):

- ``ddp``: DistributedDataParallel per stage. torch.distributed.pipelining's PipelineStage runs
  every backward but the last under ``no_sync`` (``backward_maybe_with_nosync``), so gradients
  accumulate locally and one all-reduce of G per step, ``2 (D - 1) / D x G / bandwidth``,
  starts with the stage's LAST backward. State bytes are those of one pipeline
  (``cost.state_bytes``; DDP's gradient buckets are taken as views of the gradients,
  ``gradient_as_bucket_view=True``, else they would add G).
- ``fsdp``: FSDP2 ``fully_shard`` per stage with ``reshard_after_forward=False`` (torchtitan's
  choice for PP). One all-gather of the parameters, ``(D - 1) / D x P / bandwidth``, before the
  stage's first forward, and one reduce-scatter of the gradients, ``(D - 1) / D x G /
  bandwidth``, after its last backward, instead of the all-reduce. Memory: the sharded
  parameters, gradients and optimizer state, ``factor x P / D`` (``cost.OPTIMIZER_FACTOR``),
  plus the unsharded parameters, held from the first forward to the last backward, plus the
  unsharded gradients (optimizers with gradients): PipelineStage turns gradient sync off for all
  but the last backward (``set_requires_gradient_sync(False)``), so FSDP accumulates full-size
  gradients until the reduce-scatter. A stage's state is therefore
  ``P x (1 + [factor >= 2] + factor / D) + buffers``: below DDP's ``factor x P`` only when
  ``factor / D`` buys more than the unsharded copy costs (adam: D >= 3). Buffers are not sharded.

Overlap, as the simulator (autopipe/core/simulator.py) models it: a stage's gradient collective
starts when its last backward's compute ends, runs on the device's communication stream and
does not hold up the device's compute: it overlaps the backwards that other stages still run
(stage K-1 finishes its backward first, stage 0 last, so stage 0's collective is the exposed
one). Collectives of stages that share a device (an interleaved rank's) run one after another.
The iteration ends at the latest of every stage's last event, i.e. the max over stages of (end
of its last backward + its collective). DDP's own overlap of bucketed all-reduces with the last
backward is ignored, as is contention of collectives with the transfers between stages: both
on the conservative side. The all-gather is not prefetched (FSDP2 issues it in the first
forward's pre-hook), so it delays that forward. The split itself is the bottleneck DP's
([Note: per-stage mode DP]); the collectives enter the choice of (D, K) and the rest of the
configuration through the simulated iteration. ``data_parallel=1`` adds nothing (``dp_mode``
is then ignored): every plan without replicas is costed as before.

[Note: weight gradients and the all-reduce] Under the zero-bubble schedules ([Note: split
backward] in autopipe/core/zero_bubble.py) a stage's gradients are final only after its LAST
weight-gradient part W (or whole backward B): torch's _PipelineScheduleRuntime counts both
toward ``last_backward``, which turns DDP's sync (FSDP's reduce-scatter) on for that call. So
the collective starts when that W's compute ends, and what it overlaps is what the device still
runs after it: the Ws of the last micro-batches that the schedule deferred for the rank's other
stage (a V rank holds stages r and 2W-1-r; the later one's Ws end first, so its all-reduce runs
under the earlier one's remaining Ws) and the other ranks' cool-down. The simulator models
exactly that: the collective on the communication stream from the end of the stage's last W,
the device computing on. As for 1F1B, the overlap of DDP's buckets with the W that produces the
gradients is not counted: on the conservative side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopipe.core.devices import DeviceSpec
from autopipe.errors import PartitionError
from executor.spec import DATA_PARALLEL_MODES

__all__ = [
    "check_data_parallel",
    "state_factor",
    "ring_ms",
    "allreduce_ms",
    "grad_sync_ms",
    "param_gather_ms",
    "sync_phase",
    "replica_devices",
]

Amount = Any  # a number, a numpy array or a PuLP expression, as in autopipe.core.cost


def check_data_parallel(data_parallel: Any, dp_mode: Any) -> None:
    """One line for a replica count that is not an integer >= 1 or an unknown mode."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise PartitionError(f"data_parallel={data_parallel!r}: need an integer number of "
                             f"replicas >= 1 (or 'auto' in partition)")
    if dp_mode not in DATA_PARALLEL_MODES:
        raise PartitionError(f"dp_mode={dp_mode!r}: choose one of {list(DATA_PARALLEL_MODES)}")


def state_factor(optimizer_factor: int, data_parallel: int, dp_mode: str) -> float:
    """Bytes of state per parameter byte of a stage: the optimizer factor, or under ``fsdp``
    the unsharded parameters and gradients plus the sharded state ([Note: pipeline x data
    parallel])."""
    if data_parallel == 1 or dp_mode == "ddp":
        return optimizer_factor
    grads = 1 if optimizer_factor >= 2 else 0
    return 1 + grads + optimizer_factor / data_parallel


def ring_ms(nbytes: Amount, data_parallel: int, ms_per_byte: float) -> Amount:
    """One ring pass over D ranks (an all-gather or a reduce-scatter of ``nbytes``): each rank
    sends ``(D - 1) / D`` of them."""
    return nbytes * ((data_parallel - 1) / data_parallel * ms_per_byte)


def allreduce_ms(nbytes: Amount, data_parallel: int, ms_per_byte: float) -> Amount:
    """A ring all-reduce: a reduce-scatter, then an all-gather, ``2 (D - 1) / D x bytes``."""
    return 2 * ring_ms(nbytes, data_parallel, ms_per_byte)


def grad_sync_ms(param_bytes: Amount, data_parallel: int, dp_mode: str, ms_per_byte: float) -> Amount:
    """A stage's gradient collective after its last backward: all-reduce (``ddp``) or
    reduce-scatter (``fsdp``) of its gradients (G = P bytes)."""
    if dp_mode == "fsdp":
        return ring_ms(param_bytes, data_parallel, ms_per_byte)
    return allreduce_ms(param_bytes, data_parallel, ms_per_byte)


def param_gather_ms(param_bytes: Amount, data_parallel: int, dp_mode: str, ms_per_byte: float) -> Amount:
    """A stage's parameter all-gather before its first forward (``fsdp`` only)."""
    return ring_ms(param_bytes, data_parallel, ms_per_byte) if dp_mode == "fsdp" else 0.0


def sync_phase(param_gather: float) -> str:
    """The timeline phase of a stage's gradient collective: a stage that gathers its parameters
    is sharded (``reducescatter``), else replicated (``allreduce``). Exact: under ``fsdp`` the
    gather and the reduce-scatter move the same bytes over the same ring, so both are zero or
    neither is."""
    return "reducescatter" if param_gather > 0 else "allreduce"


def replica_devices(pool: Sequence[DeviceSpec], data_parallel: int) -> list[DeviceSpec]:
    """The K = N / D stage devices of one replica: stage s takes replica 0's name and the least
    memory and speed of the D devices running it (replica r uses ``pool[r K : (r + 1) K]``)."""
    n = len(pool)
    if data_parallel < 1 or n % data_parallel:
        raise PartitionError(f"data_parallel={data_parallel} does not divide the {n} devices: "
                             f"each replica needs N / D devices; use a divisor of {n}")
    k = n // data_parallel
    out = []
    for s in range(k):
        same = [pool[r * k + s] for r in range(data_parallel)]
        limits = [d.memory for d in same if d.memory is not None]
        out.append(DeviceSpec(same[0].name, min(limits) if limits else None,
                              min(d.speed for d in same)))
    return out
