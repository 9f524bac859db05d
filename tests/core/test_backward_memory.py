"""[Note: the backward's memory] (autopipe/core/backward_memory.py): the gradients appear at a
stage's first backward, and every backward has its layer's working set on top. Checked by hand
on one stage, and against the plan's own simulation."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.core.backward_memory import first_backward_bytes, lazy_grad_bytes
from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.layer_costs import range_max
from autopipe.core.plan import Plan
from autopipe.core.profile_table import Profile
from autopipe.core.scaling import profile_at
from autopipe.core.simulator import simulate
from autopipe.errors import ProfileError
from autopipe.solvers.synthetic import chain_profile


def _chain(working: list[int] | None = (1, 2, 3)):  # type: ignore[assignment]
    prof = chain_profile([1.0, 1.0, 1.0], param_bytes=[100, 0, 50], output_bytes=5, saved_bytes=[10, 20, 30])
    if working is not None:
        prof.df["bwd_working_bytes"] = list(working)
    return prof


def test_one_gpipe_stage_by_hand() -> None:
    # sgd: state 2 x 150. Saves 60 per micro-batch, and the model's output (5) kept for the loss;
    # working sets (1, 2, 3) and the gradient each layer receives (5; the last layer's is the
    # loss's, charged with the loss). After both forwards: 150 + 2 x 65 = 280. The first backward
    # ends with every gradient and one micro-batch freed: 300 + 65 (its layers' gradients less
    # their saves, 150 - 60 = 90, is the most it has beside the 2 x 65 over the walk's level).
    # The second backward: 300 + 65 + its largest working set, 5 + 2: the peak, 372
    opts = CostOptions(chunks=2, recompute="never", optimizer="sgd", bandwidth=None)
    (stage,) = stage_costs(LayerCosts.from_profile(_chain()), [0, 0, 0], [DeviceSpec("cpu")], opts)
    assert (stage.lazy_grad_bytes, stage.first_backward_bytes, stage.working_bytes) == (150, 90, 7)
    assert stage.memory_bytes == 372
    # measured before the working sets: every gradient from the start, no working set
    (old,) = stage_costs(LayerCosts.from_profile(_chain(None)), [0, 0, 0], [DeviceSpec("cpu")], opts)
    assert old.memory_bytes == 300 + 2 * 65 and old.backward_bytes == 0


def test_the_first_backward_walks_its_layers_in_reverse() -> None:
    # layers (saved, grads, working): the backward meets layer 2 first, then 1, then 0
    saved, grads, working = np.array([10.0, 20, 30]), np.array([100.0, 0, 50]), np.array([6.0, 7, 8])
    # at layer 2: 8; done: +50 - 30 = 20; at layer 1: 20 + 7 = 27; done: 20 - 20 = 0;
    # at layer 0: 0 + 6; done: 0 + 100 - 10 = 90
    assert first_backward_bytes(saved, grads, working) == 90
    assert first_backward_bytes(saved, np.zeros(3), working) == 8  # no lazy gradients: the working sets


def test_replicas_in_ddp_buckets_keep_their_gradients() -> None:
    assert lazy_grad_bytes(10, 2, 1, "ddp", "1f1b") == 10
    assert lazy_grad_bytes(10, 2, 2, "ddp", "1f1b") == 0  # DistributedDataParallel's buckets
    assert lazy_grad_bytes(10, 2, 2, "ddp", "zbv") == 10  # autopipe all-reduces these itself
    assert lazy_grad_bytes(10, 4, 2, "fsdp", "1f1b") == 10
    assert lazy_grad_bytes(10, 1, 1, "ddp", "gpipe") == 0  # optimizer "none": no gradients kept


def test_range_max_is_every_ranges_maximum() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):  # negative values too: an empty range is not 0 inside the walk
        n = int(rng.integers(1, 12))
        values = rng.normal(size=n)
        j0 = int(rng.integers(0, n + 1))
        j1, rows = int(rng.integers(j0, n + 2)), int(rng.integers(0, n + 2))
        expected = [[max(values[i:j]) if i < j else 0.0 for j in range(j0, j1)] for i in range(rows)]
        assert np.array_equal(range_max(values, j0, j1, rows), np.array(expected).reshape(rows, j1 - j0))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv"])
def test_the_simulated_peaks_are_the_cost_models(schedule: str) -> None:
    prof = chain_profile([1.0] * 6, param_bytes=[100, 0, 50, 80, 10, 0], output_bytes=5,
                         saved_bytes=[10, 20, 30, 5, 40, 25], bwd_input_ms=[1.0] * 6, weight_grad_bytes=3)
    prof.df["bwd_working_bytes"] = [1, 60, 3, 9, 2, 30]
    plan = Plan.from_stages(prof, [["l0", "l1"], ["l2"], ["l3", "l4"], ["l5"]], chunks=4, recompute="never",
                            optimizer="sgd", schedule=schedule, bandwidth=None,
                            devices=["a", "b", "b", "a"] if schedule == "zbv" else None)
    assert any(b.backward_bytes for b in plan.breakdown)
    # each stage's walk over the order the simulator ran equals its term-wise peak
    assert simulate(plan).peak_memory == [b.memory_bytes for b in plan.breakdown]


@pytest.mark.parametrize("value", ["x", -1, None])
def test_a_bad_working_set_column_is_named_in_one_line(value: object) -> None:
    prof = _chain()
    df = prof.df.astype({"bwd_working_bytes": object})
    df.loc[1, "bwd_working_bytes"] = value
    with pytest.raises(ProfileError, match=r"column 'bwd_working_bytes' must hold numbers >= 0, layer 'l1'") as info:
        Profile.from_frame(df)
    assert "\n" not in str(info.value)


def test_scaling_keeps_the_weights_gradients_and_scales_the_rest() -> None:
    # a layer whose working set is its weight's gradient (100) and 40 bytes of activations
    prof = chain_profile([1.0], param_bytes=100, output_bytes=64, saved_bytes=32)
    prof.df["bwd_working_bytes"] = [140]
    prof.meta["micro_batch_size"] = 2
    assert profile_at(prof, 4).df["bwd_working_bytes"].tolist() == [100 + 2 * 40]


def test_one_process_gathers_the_outputs_after_the_last_forward() -> None:
    # the last layer's output (200 per micro-batch) is the model's: kept per micro-batch, and
    # executor.GPipe copies both into the batch's after the last forward. Then: 300 - 150 lazy
    # gradients + 2 x (60 + 200) + 2 x 200 = 770, above the first backward's 300 + 460
    prof = chain_profile([1.0, 1.0, 1.0], param_bytes=[100, 0, 50], output_bytes=[5, 5, 200],
                         saved_bytes=[10, 20, 30])
    prof.df["bwd_working_bytes"] = [1, 2, 3]
    opts = CostOptions(chunks=2, recompute="never", optimizer="sgd", bandwidth=None)
    (one,) = stage_costs(LayerCosts.from_profile(prof), [0, 0, 0], [DeviceSpec("cpu")], opts)
    assert (one.gathered_bytes, one.memory_bytes) == (400, 300 + 770)
    (rank,) = stage_costs(LayerCosts.from_profile(prof, runtime="distributed"), [0, 0, 0], [DeviceSpec("cpu")], opts)
    assert (rank.gathered_bytes, rank.memory_bytes) == (0, 300 + 2 * 260 + 90 - 150)
    plan = Plan.from_stages(prof, [["l0", "l1", "l2"]], chunks=2, recompute="never", optimizer="sgd", bandwidth=None)
    assert plan.peak_memory == [300 + 770]  # the simulator's walk, at the same instant
