"""StageCost: one stage's predicted time and memory, the parts kept apart (a Plan's breakdown).

autopipe.core.cost computes it (``stage_costs``); the Plan stores it as JSON, the simulator and
the plots read it. Plain data: every formula is in cost.py ([Note: cost model]).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageCost"]


@dataclass(frozen=True)
class StageCost:
    """One stage's predicted cost per micro-batch (times in ms) and peak memory (bytes)."""

    fwd_ms: float
    bwd_ms: float
    recompute_ms: float
    transfer_ms: float
    param_bytes: int  # parameters + gradients + optimizer state + buffers (+ autocast's cast
    # cache in a recomputing stage under mixed precision: [Note: mixed precision memory] in cost.py)
    activation_bytes: int
    input_bytes: int
    output_bytes: int
    saved_bytes: int  # one micro-batch's activations kept for backward
    # [Note: measured overheads]; defaults = today's model, so older plans load unchanged
    call_fwd_ms: float = 0.0
    call_bwd_ms: float = 0.0
    recompute_ratio: float = 1.0
    recompute_call_ms: float = 0.0  # per recomputed micro-batch, in recompute_ms
    latency_ms: float = 0.0  # of each crossing, in transfer_ms ([Note: transfer cost])
    receive_share: float = 0.0  # what the receiver pays of a crossing's bytes, in transfer_ms
    # per ITERATION, not in time_ms: the data-parallel collectives ([Note: pipeline x data parallel])
    grad_sync_ms: float = 0.0  # after the stage's last backward
    param_gather_ms: float = 0.0  # before its first forward (fsdp)
    # a split backward ([Note: split backward time] in cost.py): its input-gradient part I
    # (None: the profile has no split, or the schedule does not split), what a micro-batch
    # holds from I to W, and its weight-gradient part W (None, as plans saved before it: the
    # rest of bwd_ms; I + W exceeds bwd_ms by what splitting costs)
    bwd_input_ms: float | None = None
    weight_held_bytes: int = 0
    bwd_weight_ms: float | None = None
    # of input_bytes, what the stage's first layer saves: held once by a recomputed micro-batch
    # ([Note: an input kept once] in stage_memory.py); 0 in plans saved before it
    input_saved_bytes: int = 0
    # what the outputs a stage keeps per micro-batch in flight (on ranks) and, on the last stage,
    # the model's output and its loss add to its peak (0 in plans saved before it): [Note: the
    # loss's memory] in stage_memory.py
    loss_bytes: int = 0
    # what optimizer.step() holds besides the state, after the activations are freed
    # ([Note: the optimizer step's memory] in stage_memory.py); 0 in plans saved before it
    step_bytes: int = 0
    # [Note: the backward's memory] in backward_memory.py (0 in plans saved before it): the gradients
    # the stage holds only from its first backward on, what that first backward has beside its
    # activations, the largest working set of a later one, and what the three change of its peak
    # (in memory_bytes; negative where the gradients' absence before the backward outweighs them)
    lazy_grad_bytes: int = 0
    first_backward_bytes: int = 0
    working_bytes: int = 0
    gathered_bytes: int = 0  # executor.GPipe's gathered outputs, on the last stage after its last forward
    backward_bytes: int = 0
    # the runtime's receive buffers, held through the step: on ranks one per micro-batch for the
    # input and the output's gradient (0 in one process and in plans saved before it); a stage
    # that has them holds its input in them ([Note: receive buffers] in stage_memory.py)
    receive_bytes: int = 0
    sending_bytes: int = 0  # the input gradient still being sent beside a later backward (ranks)
    # whether its optimizer steps one tensor at a time (the CPU): a device's stages then step in
    # turn, holding the largest of their step_bytes, not their sum ([Note: the optimizer step's
    # memory] in stage_memory.py; False in plans saved before it)
    one_at_a_time: bool = False
    # its parameters and buffers: what building it from a meta-device model holds ([Note: the
    # build's memory] in stage_memory.py; 0 in plans saved before it)
    build_bytes: int = 0
    # of activation_bytes, what a segment of layers recomputed alone adds while it recomputes
    # ([Note: recomputed layers] in recomputed_layers.py; 0 in plans saved before it)
    recompute_bytes: int = 0
    # beside it, what torch's checkpoint holds while it back-propagates that segment: the
    # recomputed outputs and their gradients (not saves: outside activation_bytes; 0 in plans
    # saved before it)
    recompute_outputs_bytes: int = 0
    recompute_segments: int = 0  # segments of layers it recomputes alone (0 in plans saved before it)
    # of loss_bytes, what the stage keeps per micro-batch in flight and the loss's gradients, so that
    # a walk adds them where it holds the micro-batches (0 in plans saved before them: loss_bytes is
    # then added whole) ([Note: the loss's memory] in stage_memory.py)
    kept_bytes: int = 0
    loss_grad_bytes: int = 0

    @property
    def backward_ms(self) -> float:
        """The backward of one micro-batch as the plan's schedule runs it: I + W where it splits
        the backward, else ``bwd_ms``."""
        if self.bwd_input_ms is None:
            return self.bwd_ms
        return self.bwd_input_ms + (self.bwd_ms - self.bwd_input_ms if self.bwd_weight_ms is None
                                    else self.bwd_weight_ms)

    @property
    def time_ms(self) -> float:
        # = stage_time(layer_work(...), ...) with the parts kept apart
        return (self.fwd_ms + self.backward_ms + self.recompute_ms + self.call_fwd_ms
                + self.call_bwd_ms + self.transfer_ms)

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.receive_bytes + max(
            self.activation_bytes + self.recompute_outputs_bytes + self.loss_bytes + self.backward_bytes,
            self.step_bytes)
