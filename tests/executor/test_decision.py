"""executor.Decision: what a plan decides, checked once where it is made, and taken whole by
both runtimes ([Note: a plan's decision])."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from executor.decision import Decision, runtime_decision
from executor.errors import ExecutorError
from executor.local.gpipe import GPipe
from tests.models import Chain


def test_a_decision_spreads_one_mode_and_keeps_tuples() -> None:
    d = Decision([["a", "b"], ["c"]], 4, "never", devices=["cuda:0", "cuda:1"])
    assert d.stages == (("a", "b"), ("c",)) and d.recompute == ("never", "never")
    assert d.devices == ("cuda:0", "cuda:1") and d.num_stages == 2
    assert hash(d) == hash(Decision((("a", "b"), ("c",)), 4, ("never", "never"), devices=("cuda:0", "cuda:1")))


@pytest.mark.parametrize(("changes", "match"), [
    ({"chunks": 0}, r"^chunks=0 < 1: need at least one micro-batch; use chunks >= 1$"),
    ({"chunks": 2.0}, r"^chunks=2.0 is not a number of micro-batches"),
    ({"recompute": ("never",)}, r"^recompute lists 1 mode\(s\) for 2 stage\(s\)"),
    ({"recompute": "sometimes"}, r"^recompute='sometimes' is not a recompute mode"),
    ({"schedule": "zb"}, r"^schedule='zb' is unknown; use one of gpipe, 1f1b"),
    ({"merge_backward": "all"}, r"^merge_backward='all': choose one of"),
    ({"data_parallel": 0}, r"^data_parallel=0 is not a number of replicas"),
    ({"data_parallel": True}, r"^data_parallel=True is not a number of replicas"),
    ({"dp_mode": "zero3"}, r"^dp_mode='zero3' is unknown; use one of ddp, fsdp$"),
    ({"precision": "fp8"}, r"^precision='fp8' is unknown"),
    ({"devices": ("cpu",)}, r"^a decision of 2 stages names 1 devices"),
    ({"stages": ()}, r"^a decision needs at least one stage$"),
])
def test_every_field_is_checked_when_made_and_when_replaced(changes: dict, match: str) -> None:
    good = Decision.for_stages(2, chunks=4)
    with pytest.raises(ValueError, match=match):
        good.replace(**changes)
    fields = {**good.to_json(), **changes}
    with pytest.raises(ValueError, match=match):
        Decision(**fields)


def test_json_round_trip_is_plain_json_and_equal() -> None:
    d = Decision((("a",), ("b", "c")), 8, ("always", "never"), devices=("cpu", "cpu"), schedule="zbv",
                 merge_backward="adjacent", data_parallel=2, dp_mode="fsdp", recompute_layers=("b",),
                 precision="bf16")
    text = json.dumps(d.to_json())
    assert Decision.from_json(json.loads(text)) == d
    with pytest.raises(ValueError, match=r"^a decision has no field 'checkpoint'; known: "):
        Decision.from_json({**d.to_json(), "checkpoint": "never"})


def test_a_decision_prints_on_one_line() -> None:
    d = Decision((("a",), ("b",)), 8, ("always", "never"), devices=("cuda:0", "cuda:1"), data_parallel=2)
    assert str(d) == ("2 stages on cuda:0, cuda:1 | 8 micro-batches | recompute always/never | gpipe | "
                      "fp32 | x2 ddp")
    assert str(Decision.for_stages(1, chunks=1, recompute="never")) == (
        "1 stage | 1 micro-batch | recompute never | gpipe | fp32")


def test_a_runtime_takes_a_decision_or_loose_arguments_never_both() -> None:
    d = Decision.for_stages(3, chunks=4, recompute="never")
    assert runtime_decision(d, 3, chunks=None, recompute="except_last") is d
    assert runtime_decision(None, 3, chunks=4, recompute="never") == d
    with pytest.raises(ValueError, match=r"^chunks= and decision= were both given; pass "
                                         r"decision=decision.replace\(chunks=...\) alone$"):
        runtime_decision(d, 3, chunks=4)
    with pytest.raises(ValueError, match=r"^recompute= and decision= were both given"):
        runtime_decision(d, 3, chunks=None, recompute="always")
    with pytest.raises(ValueError, match=r"^the decision has 3 stages but 2 stage module\(s\) were given"):
        runtime_decision(d, 2, chunks=None)
    with pytest.raises(ValueError, match=r"^chunks= is missing: pass chunks=M"):
        runtime_decision(None, 3, chunks=None)
    with pytest.raises(ValueError, match=r"^decision=dict is not an executor.Decision"):
        runtime_decision({"chunks": 4}, 3, chunks=None)  # type: ignore[arg-type]


def test_gpipe_from_a_decision_trains_as_gpipe_from_loose_arguments() -> None:
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 8)
    twin = copy.deepcopy(model)
    decision = Decision.for_stages(2, chunks=4, recompute=("always", "never"))
    by_value = GPipe([model.net[:3], model.net[3:]], ["cpu", "cpu"], decision=decision)
    by_hand = GPipe([twin.net[:3], twin.net[3:]], ["cpu", "cpu"], 4, ["always", "never"])
    assert by_value.decision == by_hand.decision == decision
    assert by_value.recompute_modes == ["always", "never"] and by_value.chunks == 4
    out, ref = by_value(x), by_hand(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().mean().backward()
    ref.square().mean().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_gpipe_refuses_a_decision_it_cannot_run_in_one_line() -> None:
    stages = [nn.Linear(2, 2), nn.Linear(2, 2)]
    with pytest.raises(ExecutorError, match=r"^executor.GPipe runs schedule='gpipe' only, not '1f1b'; "):
        GPipe(stages, ["cpu", "cpu"], decision=Decision.for_stages(2, chunks=4, schedule="1f1b"))
    with pytest.raises(ExecutorError, match=r"^chunks= and decision= were both given"):
        GPipe(stages, ["cpu", "cpu"], 4, decision=Decision.for_stages(2, chunks=4))
    with pytest.raises(ExecutorError, match=r"^chunks= is missing"):
        GPipe(stages, ["cpu", "cpu"])
