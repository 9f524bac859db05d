"""Predicted per-stage activation memory within 10% of what the stages really keep (bytes do not
depend on the machine's load, so this is a real assertion, not a report)."""

from __future__ import annotations

import pytest

from benchmarks import memory_vs_prediction


@pytest.mark.slow
def test_activation_memory_is_predicted_within_10_percent() -> None:
    bench = memory_vs_prediction
    rows = bench.main(["--models", "mlp", "gpt", "unet", "--batch", "32"])
    assert len(rows) == 3 * 3 * 2
    for r in rows:  # except_last too: [Note: which micro-batches recompute]
        # under always the prediction counts a received copy twice (safe side: the benchmark's
        # "recompute copy"); everything else is held to 10%
        assert r.measured > 0 and 0.9 <= r.ratio_without_copy <= 1.1 and r.ratio <= 1.1, r
        assert r.stage > 0 or r.recompute_copy == 0, r


def test_a_cut_after_a_relu_is_predicted_with_the_receivers_copy() -> None:
    import autopipe
    from autopipe.examples import get_example

    bench = memory_vs_prediction
    ex = get_example("mlp", batch_size=32)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=1, warmup=0, progress=False)
    layers = prof.layers  # net.1 is a ReLU: it and net.2 (a Linear) save the same tensor
    copy = 8 * 512 * 4  # net.1's output for one micro-batch of 8 rows
    for mode in ("never", "except_last", "always"):
        plan = autopipe.Plan.from_stages(prof, [layers[:2], layers[2:]], devices=["cpu", "cpu"],
                                         chunks=4, recompute=mode)
        first, second = bench.measure_plan(ex, prof, plan)
        assert first.measured == first.predicted and first.recompute_copy == 0
        # stage 1 keeps its own copy of net.1's output: in the prediction, exactly
        assert second.recompute_copy == (copy if mode == "always" else 0)
        assert second.measured == second.predicted - second.recompute_copy
