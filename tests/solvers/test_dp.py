from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.errors import PartitionError
from autopipe.solvers import dp as dp_module
from autopipe.solvers import stage_dp
from autopipe.solvers.dp import solve_dp
from autopipe.solvers.synthetic import chain_profile, random_chain, transformer_dag
from tests.solvers.brute import least_memory, with_backward, with_buffers, with_loss


def brute_force(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> float:
    """Best bottleneck over every contiguous split, evaluated by the general cost model."""
    n, k = len(lc), len(devices)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        assignment = [s for s in range(k) for _ in range(bounds[s], bounds[s + 1])]
        costs = stage_costs(lc, assignment, devices, opts)
        if opts.ties == "colocate" and any(
            len({assignment[i] for i in members}) > 1 for members, _ in lc.tie_groups
        ):
            continue
        if all(d.memory is None or c.memory_bytes <= d.memory for c, d in zip(costs, devices, strict=True)):
            best = min(best, max(c.time_ms for c in costs))
    return float(best)


def _check(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions) -> None:
    expected = brute_force(lc, devices, opts)
    if not np.isfinite(expected):
        with pytest.raises(PartitionError):
            solve_dp(lc, devices, opts)
        return
    result = solve_dp(lc, devices, opts)
    costs = stage_costs(lc, result.assignment, devices, opts)
    assert result.bottleneck == pytest.approx(expected, rel=1e-9)
    assert max(c.time_ms for c in costs) == pytest.approx(result.bottleneck, rel=1e-9)
    assert sorted(set(result.assignment)) == list(range(len(devices)))  # no empty stage
    assert result.assignment == sorted(result.assignment)  # contiguous, in order


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.compat
def test_dp_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(3, 10)), int(rng.integers(1, 5))
    k = min(k, n)
    prof = random_chain(n, seed)
    if seed % 2:  # layers that save their input again ([Note: saved once]): copies across cuts
        prof.df["saved_shared_bytes"] = (prof.df["saved_bytes"] * rng.uniform(0, 1, n)).astype("int64")
    lc = LayerCosts.from_profile(prof)
    checkpoint = ["always", "except_last", "never"][seed % 3]
    opts = CostOptions(chunks=int(rng.integers(1, 6)), recompute=checkpoint,
                       bandwidth=[None, 1e9, 1e8][seed % 3])
    # memory limit somewhere between the tightest and a loose split, speeds 0.5..2
    total = stage_costs(lc, [0] * n, [DeviceSpec("x")], opts)[0].memory_bytes
    limit = int(total * rng.uniform(0.3, 1.0) / k) if seed % 2 else None
    speeds = rng.choice([0.5, 1.0, 2.0], k) if seed % 4 < 2 else np.ones(k)
    devices = [DeviceSpec(f"d{s}", limit, float(speeds[s])) for s in range(k)]
    _check(lc, devices, opts)


@pytest.mark.parametrize("ties", ["share", "colocate"])
def test_dp_ties_on_dag(ties: str) -> None:
    lc = LayerCosts.from_profile(transformer_dag(1))  # 10 layers, embed and head tied
    opts = CostOptions(chunks=4, ties=ties, bandwidth=1e9)
    if ties == "colocate":
        # embed and head at both ends: colocating them leaves no place to cut
        with pytest.raises(PartitionError, match="ties='colocate'.*0 places to cut"):
            solve_dp(lc, [DeviceSpec("a"), DeviceSpec("b")], opts)
    else:
        _check(lc, [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")], opts)


def test_dp_colocate_inside_span() -> None:
    prof = chain_profile([1, 5, 5, 1, 1, 1], param_bytes=[1, 8, 8, 1, 1, 1], tie_group=["", "t", "t", "", "", ""])
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(ties="colocate", bandwidth=None)
    result = solve_dp(lc, [DeviceSpec("a"), DeviceSpec("b")], opts)
    assert result.assignment[1] == result.assignment[2]
    _check(lc, [DeviceSpec("a"), DeviceSpec("b"), DeviceSpec("c")], opts)


def test_memory_limit_binds() -> None:
    prof = chain_profile([1.0] * 8, param_bytes=[100, 1000, 100, 100, 100, 100, 100, 100])
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(optimizer="none", recompute="never", bandwidth=None)
    free = solve_dp(lc, [DeviceSpec("a"), DeviceSpec("b")], opts)
    assert free.assignment == [0, 0, 0, 0, 1, 1, 1, 1]
    tight = solve_dp(lc, [DeviceSpec("a", 1250), DeviceSpec("b", 1250)], opts)
    assert tight.assignment == [0, 0, 0, 1, 1, 1, 1, 1]
    assert tight.bottleneck > free.bottleneck


def test_faster_device_gets_more_layers() -> None:
    lc = LayerCosts.from_profile(chain_profile([1.0] * 12))
    opts = CostOptions(bandwidth=None)
    result = solve_dp(lc, [DeviceSpec("slow", speed=1.0), DeviceSpec("fast", speed=3.0)], opts)
    assert result.assignment.count(1) == 9
    _check(lc, [DeviceSpec("slow", speed=1.0), DeviceSpec("fast", speed=3.0)], opts)


def test_infeasible_memory_message() -> None:
    prof = chain_profile([1.0] * 4, param_bytes=[1 << 30] * 4, saved_bytes=1 << 28)
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(optimizer="adam", recompute="never", chunks=8)
    devs = [DeviceSpec("a", 8 << 30), DeviceSpec("b", 8 << 30)]
    # best split: 2 layers per stage = 2 x 4 GiB states + 8 x 2 x 256 MiB activations = 12 GiB;
    # one layer per stage = 4 GiB + 8 x 256 MiB = 6 GiB fits: 4 stages, not "3 stages"
    with pytest.raises(PartitionError, match=r"^stage memory needs at least 12.0 GiB with recompute='never', "
                       r"optimizer='adam' and 2 stages; limit is 8.0 GiB; 4 stages are the fewest that fit "
                       r"\(--stages 4 / stages=4\)$"):
        solve_dp(lc, devs, opts)


def test_a_layer_too_big_for_the_limit_is_named_with_the_least_memory_any_split_needs() -> None:
    prof = chain_profile([1.0] * 4, param_bytes=[1 << 20, 3 << 30, 1 << 20, 1 << 20],
                         saved_bytes=1 << 20)
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(optimizer="adam", recompute="never", chunks=4)
    # the least: its 12 GiB of state, and 6 GiB more while Adam steps its tensor on the CPU, in
    # two copies ([Note: the optimizer step's memory] in stage_memory.py)
    for k in (2, 4):  # no stage count helps, and the message says so at every count
        with pytest.raises(PartitionError, match=r"^layer 'l1' alone needs 12.0 GiB for its parameters "
                           r"\(3.0 GiB\) with 'adam' optimizer state, more than the 8.0 GiB limit, so no "
                           r"split fits; the least memory any split needs is 18.0 GiB with recompute='never', "
                           r"optimizer='adam': raise the limit to that \(--memory / memory_limit=\) or split "
                           r"that layer into smaller modules$"):
            solve_dp(lc, [DeviceSpec(str(s), 8 << 30) for s in range(k)], opts)


def test_memory_message_offers_recomputation_when_it_fits() -> None:
    prof = chain_profile([1.0] * 4, param_bytes=[1 << 20] * 4, output_bytes=1 << 20,
                         saved_bytes=64 << 20)
    lc = LayerCosts.from_profile(prof)
    devs = [DeviceSpec(str(s), 300 << 20) for s in range(2)]
    # never: 8 micro-batches x 2 layers x 64 MiB = 1 GiB a stage; except_last keeps the inputs of
    # the 7 checkpointed micro-batches and the activations of the one back-propagated first
    with pytest.raises(PartitionError, match=r"with recompute='never', .*; 2 stages fit with "
                       r"recompute='except_last' \(--recompute except_last / recompute='except_last'\)$"):
        solve_dp(lc, devs, CostOptions(recompute="never", chunks=8))
    # below 2 layers' except_last 143 MiB, above one layer's 4 + 7 + 64 MiB: more stages
    tiny = [DeviceSpec(str(s), 100 << 20) for s in range(2)]
    with pytest.raises(PartitionError, match=r"; 4 stages fit with recompute='except_last' \(--stages 4 "
                       r"--recompute except_last / stages=4, recompute='except_last'\)$"):
        solve_dp(lc, tiny, CostOptions(recompute="never", chunks=8))
    # the least: one layer's 4 + 7 + 64 MiB, and on the last stage the model's 1 MiB output for each of
    # the 8 micro-batches in flight ([Note: the loss's memory])
    with pytest.raises(PartitionError, match=r"; no number of stages fits: the least memory any split needs "
                       r"is 83.0 MiB; raise the limit to that \(--memory / memory_limit=\)$"):
        solve_dp(lc, [DeviceSpec(str(s), 70 << 20) for s in range(2)], CostOptions(recompute="except_last", chunks=8))
    with pytest.raises(PartitionError, match=r"exceeds some device's limit by at least .* and these 2 devices; "
                       r"give them more memory or use recompute='except_last'$"):
        solve_dp(lc, [DeviceSpec("a", 100 << 20), DeviceSpec("b", 90 << 20)],
                 CostOptions(recompute="never", chunks=8))


def test_stage_count_errors() -> None:
    lc = LayerCosts.from_profile(chain_profile([1.0] * 3))
    with pytest.raises(PartitionError, match=r"stages=4 > 3 layers.*stages <= 3"):
        solve_dp(lc, [DeviceSpec(str(i)) for i in range(4)], CostOptions())
    with pytest.raises(PartitionError, match="at least 1 stage"):
        solve_dp(lc, [], CostOptions())


def test_dp_scales_to_2000_layers_16_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The work of a 2000-layer, 16-stage split, counted (not timed: its seconds are
    benchmarks/partition_speed.py's, under 2 s): one DP pass of at most 1 + (K-1) x ceil(N/B)
    block evaluations, each one numpy array of at most (N+1) x B cells (B = stage_dp._BLOCK),
    so O(K N^2) cells in O(K N / B) Python steps, and each block's arrays computed once for all
    the stages, not once per stage."""
    passes: list[int] = []
    blocks: list[tuple[int, int, tuple[int, ...]]] = []
    fresh: list[tuple[object, ...]] = []
    suffix_minmax, store = stage_dp.suffix_minmax, stage_dp.StageBlocks._store

    def counted_pass(n: int, r_max: int, cost: stage_dp.BlockCost) -> tuple[Any, Any]:
        def counted(r: int, j0: int, j1: int) -> Any:
            out = cost(r, j0, j1)
            blocks.append((j0, j1, out.shape))
            return out
        passes.append(r_max)
        return suffix_minmax(n, r_max, counted)

    def counted_store(self: stage_dp.StageBlocks, key: tuple[object, ...], value: Any) -> Any:
        fresh.append(key)
        return store(self, key, value)

    monkeypatch.setattr(stage_dp, "suffix_minmax", counted_pass)
    monkeypatch.setattr(stage_dp.StageBlocks, "_store", counted_store)
    n, k, width = 2000, 16, stage_dp._BLOCK
    lc = LayerCosts.from_profile(random_chain(n, 1))
    devices = [DeviceSpec(f"d{s}", 3 << 30) for s in range(k)]
    result = solve_dp(lc, devices, CostOptions())
    assert len(set(result.assignment)) == k
    assert passes == [k]  # one pass over the stage counts
    columns = math.ceil(n / width)  # the blocks of one stage count: j0 = 1, 1 + B, ...
    assert 0 < len(blocks) <= 1 + (k - 1) * columns
    assert all(shape == (j1, j1 - j0) and j1 - j0 <= width for j0, j1, shape in blocks)
    one_pass = sum(j1 * (j1 - j0) for j0, j1 in
                   ((j0, min(j0 + width, n + 1)) for j0 in range(1, n + 1, width)))
    assert sum(j1 * (j1 - j0) for j0, j1, _ in blocks) <= k * one_pass <= k * (n + 1) ** 2
    # valid, params, state, saved, work, transfers, stage time, masked time, and what AdamW's step
    # holds ([Note: the optimizer step's memory] in stage_memory.py): 9 arrays a block
    assert len(fresh) == len(set(fresh)) <= 9 * columns


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force_when_skips_are_saved_on_both_sides(seed: int) -> None:
    # a DAG whose consumers save again what their producers save ([Note: saved once]), the
    # residual stream's LayerNorm among them: an earlier consumer, not the last, keeps the copy
    rng = np.random.default_rng(seed)
    prof = transformer_dag(2)
    prof.df["saved_shared_bytes"] = (prof.df["saved_bytes"] * rng.uniform(0, 1, len(prof.df))).astype("int64")
    lc = LayerCosts.from_profile(prof)
    assert any(s and max(s) < lc.last_use[u] for u, s in enumerate(lc.savers))
    opts = CostOptions(chunks=4, recompute=["never", "always"][seed % 2], bandwidth=None)
    free = [DeviceSpec(f"d{s}") for s in range(3)]
    total = stage_costs(lc, [0] * len(lc), free[:1], opts)[0].memory_bytes
    _check(lc, [DeviceSpec(f"d{s}", int(total * rng.uniform(0.4, 0.7))) for s in range(3)], opts)


@pytest.mark.parametrize("seed", range(8))
def test_dp_matches_brute_force_where_the_loss_binds_the_last_stage(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 8)), int(rng.integers(2, 4))
    lc, without = with_loss(seed, n)
    assert lc.runtime == ("distributed" if seed % 2 else "gpipe")
    assert lc.loss_kept - without.loss_kept == 3 * int(random_chain(n, seed).df["saved_bytes"].max())
    opts = CostOptions(chunks=int(rng.integers(2, 6)), recompute=["always", "except_last", "never"][seed % 3])
    limit = int(least_memory(lc, k, opts) * rng.uniform(1.0, 1.2))  # fits, and binds
    devices = [DeviceSpec(f"d{s}", limit) for s in range(k)]
    _check(lc, devices, opts)
    # planned blind to the loss's bytes, the last stage is given more than fits
    if least_memory(without, k, opts) <= limit:
        blind = solve_dp(without, devices, opts).assignment
        assert stage_costs(lc, blind, devices, opts)[-1].memory_bytes > limit or blind == solve_dp(
            lc, devices, opts).assignment


def _backward_case(seed: int) -> tuple[LayerCosts, LayerCosts, int, CostOptions]:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 8)), int(rng.integers(2, 4))
    lc, without = with_backward(seed, n)
    opts = CostOptions(chunks=int(rng.integers(2, 6)), recompute=["never", "always", "except_last"][seed % 3],
                       optimizer=["sgd", "momentum", "none"][seed % 3], bandwidth=None,
                       schedule=("gpipe", "1f1b")[seed // 6], data_parallel=1 + seed % 2)
    return lc, without, k, opts


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_brute_force_where_the_backward_binds(seed: int) -> None:
    # [Note: the backward's memory]: the gradients appear at a stage's first backward, and each
    # backward has its largest layer's working set on top; the DP's range maxima of them must
    # pick what stage_costs' walk says fits
    lc, _, k, opts = _backward_case(seed)
    limit = int(least_memory(lc, k, opts) * np.random.default_rng(seed).uniform(1.0, 1.2))  # fits, and binds
    _check(lc, [DeviceSpec(f"d{s}", limit) for s in range(k)], opts)


def test_the_backward_terms_decide_most_of_those_cases() -> None:
    # so the test above is not passed by splits that memory never bound differently
    moved = [least_memory(lc, k, opts) != least_memory(without, k, opts)
             for lc, without, k, opts in map(_backward_case, range(12))]
    assert sum(moved) >= 9, moved


def _buffers_case(seed: int) -> tuple[LayerCosts, LayerCosts, list[DeviceSpec], CostOptions]:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 8)), int(rng.integers(2, 4))
    lc, one_process = with_buffers(seed, n)
    opts = CostOptions(chunks=int(rng.integers(2, 6)), recompute=["never", "always", "except_last"][seed % 3],
                       optimizer=("sgd", "adamw")[seed % 2], bandwidth=None, schedule=("gpipe", "1f1b")[seed // 6])
    limit = int(least_memory(lc, k, opts) * rng.uniform(1.0, 1.1))  # fits, and binds
    return lc, one_process, [DeviceSpec(f"d{s}", limit) for s in range(k)], opts


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_brute_force_where_the_receive_buffers_bind(seed: int) -> None:
    # [Note: receive buffers]: a buffer per micro-batch for a stage's input and its output's
    # gradient, which hold the input the walk then does not, and the input gradient in flight
    lc, _, devices, opts = _buffers_case(seed)
    _check(lc, devices, opts)


def test_planned_blind_to_the_receive_buffers_a_rank_is_given_more_than_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [_buffers_case(seed) for seed in range(12)]
    best = [solve_dp(lc, devices, opts).assignment for lc, _, devices, opts in cases]
    for module in (dp_module, stage_dp):  # the DPs as they were before them
        monkeypatch.setattr(module, "receive_bytes", lambda *args: 0)
    over = 0
    for (lc, _, devices, opts), right in zip(cases, best, strict=True):
        blind = solve_dp(lc, devices, opts).assignment
        limit = devices[0].memory
        assert limit is not None
        too_much = max(c.memory_bytes for c in stage_costs(lc, blind, devices, opts)) > limit
        assert too_much or blind == right
        over += too_much
    assert over >= 2, over  # so the buffers decide (2 of these 12 cases, 3 before recomputed outputs were charged)


def test_the_fewest_stages_under_an_interleaved_schedule_fill_whole_ranks() -> None:
    # 5 layers of 4 GiB state, one a stage at most: 5 stages fit, but interleaved 1F1B runs two
    # stages a rank, so the count to ask for is 6 (3 ranks), never an odd one
    prof = chain_profile([1.0] * 5, param_bytes=[1 << 30] * 5, saved_bytes=1 << 20)
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(optimizer="adam", recompute="never", chunks=4, schedule="interleaved1f1b")
    devs = [DeviceSpec(name, 7 << 30) for name in ("a", "b", "a", "b")]
    with pytest.raises(PartitionError, match=r"; 6 stages \(3 ranks of 2 stages, interleaved1f1b\) are the fewest "
                                             r"that fit \(--stages 6 / stages=6\)$"):
        solve_dp(lc, devs, opts)
