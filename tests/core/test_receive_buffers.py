"""[Note: receive buffers] (autopipe/core/stage_memory.py): on ranks a stage holds a receive
buffer per micro-batch for its input and for its output's gradient through the step, its input
lives in them, and a backward's input gradient stays while it is sent. Checked by hand on two
stages, against the plan's own simulation, and through the optimizer step."""

from __future__ import annotations

import pytest

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.plan import Plan
from autopipe.core.simulator import simulate
from autopipe.solvers.synthetic import chain_profile


def _chain(working: bool):  # type: ignore[no-untyped-def]
    # every cut carries 8 bytes; l1 saves all of its input (8 of its 20)
    prof = chain_profile([1.0, 1.0, 1.0], output_bytes=8, saved_bytes=[10, 20, 30])
    prof.df["saved_input_bytes"] = [0, 8, 0]
    if working:
        prof.df["bwd_working_bytes"] = [0, 0, 0]
    return prof


@pytest.mark.parametrize("working", [False, True])
def test_two_stages_on_ranks_by_hand(working: bool) -> None:
    # 1F1B, 2 micro-batches, stages [l0] [l1 l2], no optimizer state. Each stage: 2 buffers of 8
    # (stage 0 for its output's gradient, stage 1 for its input) = 16.
    # Stage 0 holds both micro-batches: 2 x (10 saved + 8 output kept for the backward) = 36.
    # With the working sets: its first backward has l0's (the 8 bytes of gradient l1 sends) on
    # top: 44; nothing is sent back from the first stage.
    # Stage 1 holds one: its saves less l1's save of the received input, 50 - 8, and the model's
    # output, 8 = 50. With the working sets: at its second micro-batch's backward, the first
    # one's input gradient (8) still being sent, and the largest working set (l1's: 8) = 66.
    opts = CostOptions(chunks=2, recompute="never", optimizer="none", bandwidth=None, schedule="1f1b")
    lc = LayerCosts.from_profile(_chain(working), runtime="distributed")
    first, last = stage_costs(lc, [0, 1, 1], [DeviceSpec("a"), DeviceSpec("b")], opts)
    assert (first.receive_bytes, last.receive_bytes) == (16, 16)
    assert (first.memory_bytes, last.memory_bytes) == ((16 + 44, 16 + 66) if working else (16 + 36, 16 + 50))
    # in one process nothing is received, and stage 1 holds the input l1 saves once, in its saves
    one = stage_costs(LayerCosts.from_profile(_chain(working), runtime="gpipe"), [0, 1, 1],
                      [DeviceSpec("a"), DeviceSpec("b")], CostOptions(chunks=2, recompute="never", optimizer="none",
                                                                       bandwidth=None))
    assert [c.receive_bytes for c in one] == [0, 0]


def test_a_recomputed_micro_batch_holds_its_input_in_its_buffer() -> None:
    # recompute="always", GPipe: stage 1 keeps each micro-batch's input (8) until its backward;
    # on ranks that is the buffer, so the walk holds nothing of it and only the recomputation's
    # saves less the save of the input: 16 + 50 - 8 + 8 (the model's output, kept per micro-batch
    # in flight: 2 x 8 at the last forward, 8 at the recomputation) = max(16 + 2 x 8, 16 + 42 + 8)
    opts = CostOptions(chunks=2, recompute="always", optimizer="none", bandwidth=None)
    lc = LayerCosts.from_profile(_chain(False), runtime="distributed")
    _, last = stage_costs(lc, [0, 1, 1], [DeviceSpec("a"), DeviceSpec("b")], opts)
    assert last.memory_bytes == 16 + 42 + 8 + 8


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv"])
def test_the_simulated_peaks_on_ranks_are_the_cost_models(schedule: str) -> None:
    prof = chain_profile([1.0] * 6, param_bytes=[100, 0, 50, 80, 10, 0], output_bytes=[5, 40, 7, 60, 3, 9],
                         saved_bytes=[10, 60, 30, 70, 40, 25], bwd_input_ms=[1.0] * 6, weight_grad_bytes=3)
    prof.df["saved_input_bytes"] = [0, 5, 40, 7, 60, 3]
    prof.df["bwd_working_bytes"] = [1, 60, 3, 9, 2, 30]
    plan = Plan.from_stages(prof, [["l0", "l1"], ["l2"], ["l3", "l4"], ["l5"]], chunks=4, recompute="except_last",
                            optimizer="adamw", schedule=schedule, bandwidth=None, runtime="distributed",
                            devices=["a", "b", "b", "a"] if schedule == "zbv" else None)
    assert all(b.receive_bytes for b in plan.breakdown)
    assert simulate(plan).peak_memory == [b.memory_bytes for b in plan.breakdown]


def test_the_buffers_stay_through_the_optimizer_step() -> None:
    # a stage whose optimizer step outweighs its activations: state + buffers + the step's
    prof = chain_profile([1.0, 1.0], param_bytes=[0, 1000], output_bytes=8, saved_bytes=[1, 1])
    opts = CostOptions(chunks=2, recompute="never", optimizer="adamw", bandwidth=None)
    _, last = stage_costs(LayerCosts.from_profile(prof, runtime="distributed"), [0, 1],
                          [DeviceSpec("a"), DeviceSpec("b")], opts)
    assert last.step_bytes > last.activation_bytes + last.loss_bytes + last.backward_bytes
    assert last.memory_bytes == last.param_bytes + 16 + last.step_bytes


def test_what_the_last_stage_receives_of_the_models_outputs_is_not_kept_again() -> None:
    # l1's output (8) and l2's (8) are returned: a last stage [l2] receives l1's into its
    # buffers, so it keeps only its own per micro-batch; [l1, l2] keeps both; one process both
    prof = chain_profile([1.0, 1.0, 1.0], output_bytes=8, saved_bytes=[10, 20, 30])
    prof.df["returned_bytes"] = [0, 8, 8]
    opts = CostOptions(chunks=2, recompute="never", optimizer="none", bandwidth=None)
    two = [DeviceSpec("a"), DeviceSpec("b")]
    ranks = LayerCosts.from_profile(prof, runtime="distributed")
    assert stage_costs(ranks, [0, 0, 1], two, opts)[1].kept_bytes == 8
    assert stage_costs(ranks, [0, 1, 1], two, opts)[1].kept_bytes == 16
    assert stage_costs(LayerCosts.from_profile(prof, runtime="gpipe"), [0, 0, 1], two, opts)[1].kept_bytes == 16


def test_between_two_stages_of_one_rank_the_output_is_handed_over_in_place() -> None:
    # ZB-V on 2 ranks: stages 1 and 2 are rank b's. Stage 1's output lives in stage 2's receive
    # buffers, so stage 1 keeps none of its own; stage 2's input gradient lands in stage 1's
    # buffers, so nothing is being sent. Across ranks (0 -> 1, 2 -> 3) as before.
    prof = chain_profile([1.0] * 4, output_bytes=[5, 7, 11, 13], saved_bytes=10, bwd_input_ms=[1.0] * 4)
    prof.df["bwd_working_bytes"] = 0  # measured: the input gradient in flight is charged beside them
    plan = Plan.from_stages(prof, [["l0"], ["l1"], ["l2"], ["l3"]], chunks=4, recompute="never", optimizer="none",
                            schedule="zbv", bandwidth=None, runtime="distributed", devices=["a", "b", "b", "a"])
    b = plan.breakdown
    assert [s.kept_bytes for s in b] == [5, 0, 11, 13]  # the last: the model's output
    assert [s.sending_bytes for s in b] == [0, 5, 0, 11]
    assert [s.receive_bytes for s in b] == [4 * 5, 4 * (5 + 7), 4 * (7 + 11), 4 * 11]
