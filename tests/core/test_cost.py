from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from autopipe.core.backward_memory import backward_extras
from autopipe.core.cost import (
    DeviceSpec,
    LayerCosts,
    activation_bytes,
    activation_peak,
    activation_terms,
    resolve_devices,
    stage_costs,
    stage_terms,
)
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.core.schedules import stage_order
from autopipe.core.stage_memory import FIRST_BACKWARD, IN_BACKWARD
from autopipe.errors import PartitionError
from autopipe.solvers.synthetic import random_chain


def _diamond() -> Profile:
    # a -> b -> d, a -> c -> d, plus a skip a -> d
    df = pd.DataFrame({
        "layer": ["a", "b", "c", "d"],
        "fwd_ms": [1.0, 2.0, 3.0, 4.0],
        "bwd_ms": [2.0, 4.0, 6.0, 8.0],
        "param_bytes": [10, 20, 30, 40],
        "output_bytes": [100, 200, 300, 400],
        "saved_bytes": [1000, 2000, 3000, 4000],
    })
    edges = [("a", "b", 100), ("a", "c", 100), ("b", "d", 200), ("c", "d", 300)]
    return Profile.from_frame(df, edges=edges)


def test_resolve_devices() -> None:
    devs = resolve_devices(3, None, "1KB")
    assert [d.memory for d in devs] == [1000] * 3
    devs = resolve_devices(None, ["cuda:0", DeviceSpec("cuda:1", 500, 2.0)], 800)
    assert devs == [DeviceSpec("cuda:0", 800), DeviceSpec("cuda:1", 500, 2.0)]
    with pytest.raises(PartitionError, match="stages=3 but 2 devices"):
        resolve_devices(3, ["a", "b"])
    with pytest.raises(PartitionError, match="stages=0"):
        resolve_devices(0, None)
    with pytest.raises(PartitionError, match="give stages=K or devices"):
        resolve_devices(None, None)
    with pytest.raises(PartitionError, match="speed must be > 0"):
        DeviceSpec("x", speed=0)


def test_options_validation() -> None:
    with pytest.raises(PartitionError, match="recompute='sometimes'"):
        CostOptions(recompute="sometimes")
    with pytest.raises(PartitionError, match="optimizer='lion'"):
        CostOptions(optimizer="lion")
    with pytest.raises(PartitionError, match="chunks=0"):
        CostOptions(chunks=0)
    with pytest.raises(PartitionError, match="ties="):
        CostOptions(ties="maybe")


def test_cut_bytes_count_pass_through() -> None:
    lc = LayerCosts.from_profile(_diamond())
    # cut before b: a's value (100); before c: a (still used by c) + b (200); before d: b + c
    assert lc.cut_bytes().tolist() == [0, 100, 300, 500, 0]


def test_stage_costs_hand_computed() -> None:
    lc = LayerCosts.from_profile(_diamond())
    opts = CostOptions(chunks=4, recompute="never", optimizer="adam", bandwidth=1e6)
    # stages: {a, c} | {b, d}: a's value crosses cut 0 (b needs it), c's value also crosses
    s0, s1 = stage_costs(lc, [0, 1, 0, 1], [DeviceSpec("x"), DeviceSpec("y", speed=2.0)], opts)
    assert s0.output_bytes == 100 + 300 and s1.input_bytes == 400
    assert s0.fwd_ms == 4.0 and s0.bwd_ms == 8.0 and s0.recompute_ms == 0.0
    assert s0.transfer_ms == pytest.approx(400 * 1000 / 1e6)  # sends activations forward
    assert s1.transfer_ms == pytest.approx(400 * 1000 / 1e6)  # sends their gradients back
    assert s1.fwd_ms == 3.0 and s1.bwd_ms == 6.0  # (2 + 4) / speed 2
    assert s0.param_bytes == 40 * 4 and s0.activation_bytes == 4 * 4000
    # the last stage keeps the model's output (d's 400 bytes) for each of the 4 micro-batches in
    # flight ([Note: the loss's memory]); no loss was profiled
    assert s0.loss_bytes == 0 and s1.loss_bytes == 4 * 400
    assert s1.memory_bytes == 60 * 4 + 4 * 6000 + 4 * 400


@pytest.mark.parametrize(
    ("recompute", "recompute_ms", "act1"),
    [("always", 3.0, 4 * 400 + 6000), ("except_last", 3.0 * 3 / 4, 3 * 400 + 6000), ("never", 0.0, 4 * 6000)],
)
def test_recompute_modes(recompute: str, recompute_ms: float, act1: int) -> None:
    lc = LayerCosts.from_profile(_diamond())
    opts = CostOptions(chunks=4, recompute=recompute, optimizer="sgd", bandwidth=None)
    s0, s1 = stage_costs(lc, [0, 1, 0, 1], [DeviceSpec("x"), DeviceSpec("y", speed=2.0)], opts)
    assert s1.recompute_ms == pytest.approx(recompute_ms)
    assert s1.activation_bytes == act1
    assert s0.transfer_ms == 0.0 and s1.param_bytes == 60 * 2


def test_tied_bytes_charged_to_every_holder() -> None:
    df = _diamond().df.assign(tie_group=["w", "", "", "w"], param_bytes=[50, 20, 30, 50])
    lc = LayerCosts.from_profile(Profile.from_frame(df, edges=_diamond().edges))
    opts = CostOptions(optimizer="none")
    devs = [DeviceSpec("x"), DeviceSpec("y")]
    s0, s1 = stage_costs(lc, [0, 0, 1, 1], devs, opts)
    assert (s0.param_bytes, s1.param_bytes) == (50 + 20, 30 + 50)
    (single,) = stage_costs(lc, [0, 0, 0, 0], devs[:1], opts)
    assert single.param_bytes == 50 + 20 + 30


@pytest.mark.parametrize(("optimizer", "device", "dp_mode", "step"), [
    ("adam", "cpu", "ddp", 2 * 40),  # one tensor at a time: two copies of the largest layer's (d's)
    ("adamw", "cuda", "ddp", 60),  # all at once (foreach): one copy of every parameter of the stage
    ("adamw", "cuda", "fsdp", 60 / 2),  # of its shard
    ("sgd", "cpu", "ddp", 0), ("momentum", "cuda", "ddp", 0),  # in place
])
def test_the_optimizer_step_holds_temporaries_after_the_activations_are_freed(
        optimizer: str, device: str, dp_mode: str, step: float) -> None:
    prof = _diamond()
    prof = Profile.from_frame(prof.df, edges=prof.edges, meta={"device_type": device})
    opts = CostOptions(chunks=4, recompute="never", optimizer=optimizer, bandwidth=None,
                       data_parallel=2, dp_mode=dp_mode)
    _, s1 = stage_costs(LayerCosts.from_profile(prof), [0, 1, 0, 1], [DeviceSpec("x"), DeviceSpec("y")], opts)
    assert s1.step_bytes == step  # stage 1 holds b (20 bytes) and d (40)
    assert s1.memory_bytes == s1.param_bytes + max(s1.activation_bytes + s1.loss_bytes, s1.step_bytes)
    # a stage whose activations are smaller than its step peaks at the step
    small = dataclasses.replace(LayerCosts.from_profile(prof), saved=np.zeros(4, dtype=np.int64), loss_kept=0,
                                value_bytes=np.zeros(4, dtype=np.int64))
    _, bare = stage_costs(small, [0, 1, 0, 1], [DeviceSpec("x"), DeviceSpec("y")], opts)
    assert bare.activation_bytes == bare.loss_bytes == 0 and bare.memory_bytes == bare.param_bytes + step


def test_tied_bytes_charged_once_to_stages_sharing_a_device_in_one_process_or_a_rank() -> None:
    df = _diamond().df.assign(tie_group=["w", "", "", "w"], param_bytes=[50, 20, 30, 50])
    prof = Profile.from_frame(df, edges=_diamond().edges)
    one_cpu = [DeviceSpec("cpu"), DeviceSpec("cpu")]
    s0, s1 = stage_costs(LayerCosts.from_profile(prof), [0, 0, 1, 1], one_cpu, CostOptions(optimizer="none"))
    assert (s0.param_bytes, s1.param_bytes) == (50 + 20, 30)  # executor.GPipe: one tensor on the one CPU
    ranks = LayerCosts.from_profile(prof, runtime="distributed")  # each rank its own copy
    s0, s1 = stage_costs(ranks, [0, 0, 1, 1], one_cpu, CostOptions(optimizer="none"))
    assert (s0.param_bytes, s1.param_bytes) == (50 + 20, 30 + 50)
    # ZB-V on 2 ranks: rank 0 holds stages 0 and 3, one module's tensor for both
    split = df.assign(bwd_input_ms=df["bwd_ms"] / 2, bwd_weight_ms=df["bwd_ms"] / 2, weight_grad_bytes=0)
    v = [DeviceSpec("r0"), DeviceSpec("r1"), DeviceSpec("r1"), DeviceSpec("r0")]
    stages = stage_costs(LayerCosts.from_profile(Profile.from_frame(split, edges=_diamond().edges),
                                                 runtime="distributed"),
                         [0, 1, 2, 3], v, CostOptions(optimizer="none", schedule="zbv"))
    assert [st.param_bytes for st in stages] == [50, 20, 30, 0]


@pytest.mark.parametrize(("mode", "recomputed"), [("never", 0), ("except_last", 5), ("always", 6)])
def test_gpipe_activation_terms_in_closed_form(mode: str, recomputed: int) -> None:
    # ScheduleGPipe holds every micro-batch after the forwards: the R checkpointed ones (the last
    # R, back-propagated last) as inputs, the others whole; its first recomputation comes after
    # those others are freed: R inputs + max(M - R, 1) saved ([Note: which micro-batches recompute]);
    # where all M are, that one recomputing holds its input once ([Note: an input kept once]).
    # The first backward holds the most; a later one (IN_BACKWARD) one micro-batch less, beside
    # every gradient ([Note: the backward's memory])
    m = 6
    first, later = FIRST_BACKWARD, IN_BACKWARD
    expected = {0: ((0, m - 1, 0, 0, later), (0, m, 0, 0, first)),
                5: ((5, 1, 0, 0, first), (5, 1, 0, 1, later)),
                6: ((5, 1, 0, 1, later), (6, 1, 0, 1, first))}[recomputed]
    assert stage_terms("gpipe", 2, 4, m, recomputed) == expected
    top = max(expected, key=lambda t: t[0] * 10 + t[1] * 1000)  # the activations alone
    assert activation_bytes(10, 1000, expected) == top[0] * 10 + top[1] * 1000
    assert activation_bytes(10, 1000, expected, input_saved=4) == max(
        t[0] * 10 + t[1] * 1000 - t[3] * 4 for t in expected)
    # beside the backward: before it none of the lazy gradients (-50), in the first 30 - 50, in a
    # later one a working set of 40 (backward_extras' order)
    extras = backward_extras(50, 30, 40)
    assert activation_bytes(10, 1000, expected, extras=extras) == max(
        t[0] * 10 + t[1] * 1000 + extras[t[4]] for t in expected)


def test_1f1b_holds_at_most_k_minus_s_micro_batches() -> None:
    for s in range(4):  # each backward but the first holds as many: a later one is the peak
        assert stage_terms("1f1b", s, 4, 8, 0) == ((0, 4 - s, 0, 0, IN_BACKWARD),)  # never: K - s saved
        assert stage_terms("1f1b", s, 4, 8, 8) == ((4 - s, 1, 0, 1, IN_BACKWARD),)  # always: inputs + one recompute
    # fewer micro-batches than stages: the first backward holds both
    assert stage_terms("1f1b", 0, 4, 2, 0) == ((0, 1, 0, 0, IN_BACKWARD), (0, 2, 0, 0, FIRST_BACKWARD))


def test_peak_is_the_walk_over_the_order() -> None:
    # one stage's peak from its terms equals walking its operations with the bytes themselves
    for schedule in ("gpipe", "1f1b"):
        for r in (0, 3, 4):
            ops = stage_order(schedule, 1, 3, 4)
            for inp, saved in ((10, 1000), (1000, 10), (0, 7)):
                walked = activation_peak(ops, {1: r}, {1: inp}, {1: saved})
                assert walked == activation_bytes(inp, saved, activation_terms(ops, r))


def test_per_stage_modes() -> None:
    lc = LayerCosts.from_profile(_diamond())
    devs = [DeviceSpec("x"), DeviceSpec("y")]
    mixed = CostOptions(chunks=4, recompute=["always", "never"], optimizer="sgd", bandwidth=None)
    assert mixed.recompute == ("always", "never") and mixed.recomputed(2) == [4, 0]
    s0, s1 = stage_costs(lc, [0, 1, 0, 1], devs, mixed)
    a0, _ = stage_costs(lc, [0, 1, 0, 1], devs, CostOptions(4, "always", "sgd", None))
    _, n1 = stage_costs(lc, [0, 1, 0, 1], devs, CostOptions(4, "never", "sgd", None))
    assert (s0, s1) == (a0, n1)  # each stage exactly as if every stage ran its mode
    with pytest.raises(PartitionError, match=r"recompute lists 2 mode\(s\) for 3 stage\(s\)"):
        stage_costs(lc, [0, 1, 2, 2], devs + [DeviceSpec("z")], mixed)
    with pytest.raises(PartitionError, match=r"recompute\[1\]='sometimes' is not a recompute mode"):
        CostOptions(recompute=["never", "sometimes"])
    with pytest.raises(PartitionError, match="schedule='zigzag'"):
        CostOptions(schedule="zigzag")


def test_interleaved_devices_take_turns() -> None:
    lc = LayerCosts.from_profile(_diamond())
    opts = CostOptions(chunks=2, schedule="interleaved1f1b", bandwidth=None)
    costs = stage_costs(lc, [0, 1, 2, 3], [DeviceSpec(n) for n in ("r0", "r1", "r0", "r1")], opts)
    assert len(costs) == 4
    with pytest.raises(PartitionError, match="stage s on rank s % ranks"):
        stage_costs(lc, [0, 1, 2, 3], [DeviceSpec(n) for n in ("r0", "r0", "r1", "r1")], opts)


def test_a_received_value_both_sides_save_is_held_once_per_side() -> None:
    # [Note: saved once]: a (ReLU) saves its 100-byte output, b (Linear) saves it again as input
    df = pd.DataFrame({"layer": ["a", "b", "c"], "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3,
                       "param_bytes": [0] * 3, "output_bytes": [100] * 3,
                       "saved_bytes": [100, 100 + 40, 10], "saved_shared_bytes": [0, 100, 0]})
    lc = LayerCosts.from_profile(Profile(df, [("a", "b", 100), ("b", "c", 100)], {}))
    assert lc.saved.tolist() == [100, 40, 10] and lc.resaved.tolist() == [100, 0, 0]
    opts = CostOptions(chunks=1, recompute="never", optimizer="none", bandwidth=None)
    devs = [DeviceSpec("x"), DeviceSpec("y")]
    together, = stage_costs(lc, [0, 0, 0], devs[:1], opts)
    assert together.saved_bytes == 150  # one process, one tensor
    first, second = stage_costs(lc, [0, 1, 1], devs, opts)
    assert (first.saved_bytes, second.saved_bytes) == (100, 100 + 40 + 10)  # b keeps its copy
    first, second = stage_costs(lc, [0, 0, 1], devs, opts)
    assert (first.saved_bytes, second.saved_bytes) == (140, 10)  # c saves nothing of b's output


def test_a_value_saved_by_an_earlier_consumer_than_its_last_is_held_where_that_one_runs() -> None:
    # a U-Net's skip: a (ReLU) saves its 100-byte output, b (a pool) saves it again as input,
    # c (a concatenation, a's last consumer) saves nothing of it
    df = pd.DataFrame({"layer": ["a", "b", "c"], "fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3,
                       "param_bytes": [0] * 3, "output_bytes": [100, 30, 130],
                       "saved_bytes": [100, 100, 0], "saved_shared_bytes": [0, 100, 0]})
    lc = LayerCosts.from_profile(Profile(df, [("a", "b", 100), ("a", "c", 100), ("b", "c", 30)], {}))
    assert lc.resaved.tolist() == [100, 0, 0] and lc.savers == ((1,), (), ())
    # a stage from b on holds its copy of a's output for b; a stage from c on holds none
    assert lc.cut_bytes().tolist() == [0, 100, 130, 0] and lc.resaved_cut().tolist() == [0, 100, 0, 0]
    opts = CostOptions(chunks=1, recompute="never", optimizer="none", bandwidth=None)
    devs = [DeviceSpec("x"), DeviceSpec("y")]
    first, second = stage_costs(lc, [0, 1, 1], devs, opts)
    assert (first.saved_bytes, second.saved_bytes) == (100, 100)
    first, second = stage_costs(lc, [0, 0, 1], devs, opts)
    assert (first.saved_bytes, second.saved_bytes) == (100, 0)


@pytest.mark.parametrize(("j0", "j1", "rows"), [(1, 10, 10), (0, 4, 4), (3, 7, 7), (5, 10, 3)])
def test_the_largest_layer_of_every_range_is_the_brute_force_one(j0: int, j1: int, rows: int) -> None:
    lc = LayerCosts.from_profile(random_chain(9, 3))
    p = lc.layer_params
    assert p is not None and len(set(p.tolist())) > 3
    want = [[max(p[i:j]) if i < j else 0 for j in range(j0, j1)] for i in range(rows)]
    assert lc.largest_params(j0, j1, rows).tolist() == want


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_a_rank_of_two_stages_steps_them_in_one_optimizer(one_at_a_time: bool) -> None:
    # [Note: the optimizer step's memory]: ZB-V's rank a holds stages 0 and 3; one tensor at a
    # time it holds twice its largest layer's (the larger stage's step_bytes), all at once
    # (foreach) both stages' parameters
    from autopipe.core.plan import Plan
    from autopipe.solvers.synthetic import chain_profile

    prof = chain_profile([1.0] * 4, param_bytes=[4000, 10, 10, 3000], output_bytes=1, saved_bytes=1,
                         bwd_input_ms=[1.0] * 4)
    prof.meta["device_type"] = "cpu" if one_at_a_time else "cuda"
    plan = Plan.from_stages(prof, [["l0"], ["l1"], ["l2"], ["l3"]], chunks=2, recompute="never", optimizer="adamw",
                            schedule="zbv", bandwidth=None, runtime="distributed", devices=["a", "b", "b", "a"])
    first, last = plan.breakdown[0], plan.breakdown[3]
    assert (first.step_bytes, last.step_bytes) == ((8000, 6000) if one_at_a_time else (4000, 3000))
    state = first.param_bytes + last.param_bytes + first.receive_bytes + last.receive_bytes
    assert plan.device_memory["a"] == state + (8000 if one_at_a_time else 7000)
