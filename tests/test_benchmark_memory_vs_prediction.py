"""Predicted per-stage activation memory within 10% of what the stages really keep (bytes do not
depend on the machine's load, so this is a real assertion, not a report)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _module():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_vs_prediction.py"
    spec = importlib.util.spec_from_file_location("memory_vs_prediction", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_vs_prediction"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_activation_memory_is_predicted_within_10_percent() -> None:
    bench = _module()
    rows = bench.main(["--models", "mlp", "gpt", "unet", "--batch", "32"])
    assert len(rows) == 3 * 3 * 2
    for r in rows:  # except_last too: [Note: which micro-batches recompute]
        # the cost model leaves out one known term, the consuming stage's copy of a cut value
        # both sides save (the benchmark's "cut copies"); everything else is held to 10%
        assert r.measured > 0 and 0.9 <= r.ratio_with_copies <= 1.1, r
        assert r.stage > 0 or r.cut_copies == 0, r


def test_a_cut_after_a_relu_leaves_exactly_the_known_copy_out() -> None:
    import autopipe
    from autopipe.examples import get_example

    bench = _module()
    ex = get_example("mlp", batch_size=32)
    prof = autopipe.profile(ex.model, ex.inputs, chunks=4, repeats=1, warmup=0, progress=False)
    layers = prof.layers  # net.1 is a ReLU: it and net.2 (a Linear) save the same tensor
    for mode, kept in (("never", 4), ("except_last", 1), ("always", 0)):
        plan = autopipe.Plan.from_stages(prof, [layers[:2], layers[2:]], devices=["cpu", "cpu"],
                                         chunks=4, checkpoint=mode)
        first, second = bench.measure_plan(ex, prof, plan)
        assert first.cut_copies == 0 and first.measured == first.predicted
        assert second.cut_copies == kept * 8 * 512 * 4  # 8 rows of net.1's 512 outputs per micro-batch
        assert second.measured == second.predicted + second.cut_copies
