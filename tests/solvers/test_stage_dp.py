"""[Note: per-stage mode DP]: a recompute mode per stage, every stage count in one pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.solvers.stage_dp import StageBlocks, budget_devices, solve_counts, solve_split
from autopipe.solvers.synthetic import chain_profile, random_chain, transformer_dag
from executor.spec import RECOMPUTE_MODES
from tests.solvers.brute import least_memory, with_backward, with_buffers, with_loss

MODES = tuple(RECOMPUTE_MODES)


def brute_force(lc: LayerCosts, devices: list[DeviceSpec], opts: CostOptions,
                plan_devices: list[DeviceSpec] | None = None) -> float:
    """Best bottleneck over every contiguous split AND every mode per stage, each stage within
    its device's memory, evaluated by the general cost model."""
    n, k = len(lc), len(devices)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        assignment = [s for s in range(k) for _ in range(bounds[s], bounds[s + 1])]
        for modes in itertools.product(MODES, repeat=k):
            o = CostOptions(opts.chunks, modes, opts.optimizer, opts.bandwidth, opts.ties, opts.schedule)
            costs = stage_costs(lc, assignment, plan_devices or devices, o)
            if all(d.memory is None or c.memory_bytes <= d.memory for c, d in zip(costs, devices, strict=True)):
                best = min(best, max(c.time_ms for c in costs))
    return float(best)


@pytest.mark.parametrize("seed", range(18))
def test_per_stage_modes_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 8))
    k = min(n, int(rng.integers(1, 4)))
    prof = random_chain(n, seed)
    if seed % 3 == 0:  # layers that save their input again ([Note: saved once]): copies across cuts
        prof.df["saved_shared_bytes"] = (prof.df["saved_bytes"] * rng.uniform(0, 1, n)).astype("int64")
    if seed % 4 == 1:  # measured overheads: per-schedule calls and checkpointing's fixed cost
        prof = Profile(prof.df, prof.edges, {
            **prof.meta, "stage_call_fwd_ms": 0.2, "stage_call_bwd_ms": 0.1, "recompute_ratio": 1.3,
            "recompute_call_ms": float(rng.uniform(0.1, 2.0)), "stage_call_1f1b_fwd_ms": 0.5,
            "stage_call_1f1b_bwd_ms": 0.3, "comm_latency_ms": 0.05, "comm_receive_share": 1.1})
    lc = LayerCosts.from_profile(prof)
    schedule = ("gpipe", "1f1b")[seed % 2]
    opts = CostOptions(chunks=int(rng.integers(1, 6)), schedule=schedule,
                       bandwidth=(None, 1e9, 1e8)[seed % 3])
    whole = stage_costs(lc, [0] * n, [DeviceSpec("x")], CostOptions(opts.chunks, "never"))[0].memory_bytes
    limit = int(whole * rng.uniform(0.2, 0.9) / k)  # tight enough that modes differ per stage
    devices = [DeviceSpec(f"d{s}", limit, float(rng.choice([0.5, 1.0, 2.0]))) for s in range(k)]
    expected = brute_force(lc, devices, opts)
    split = solve_split(lc, devices, opts, modes="auto")
    if not np.isfinite(expected):
        assert split is None
        return
    assert split is not None and split.bottleneck == pytest.approx(expected, rel=1e-9)
    chosen = CostOptions(opts.chunks, tuple(split.modes), opts.optimizer, opts.bandwidth, opts.ties, schedule)
    costs = stage_costs(lc, split.assignment, devices, chosen)
    assert max(c.time_ms for c in costs) == pytest.approx(split.bottleneck, rel=1e-9)
    assert all(c.memory_bytes <= limit for c in costs)


def test_interleaved_stages_share_their_rank_s_memory() -> None:
    lc = LayerCosts.from_profile(random_chain(6, 3))
    opts = CostOptions(chunks=4, schedule="interleaved1f1b", bandwidth=None)
    ranks = [DeviceSpec(n, 60 << 20) for n in ("a", "b", "a", "b")]
    bounded = budget_devices(ranks, "interleaved1f1b")
    assert [d.memory for d in bounded] == [30 << 20] * 4  # two stages per rank, half each
    split = solve_split(lc, bounded, opts, modes="auto")
    assert split is not None
    assert split.bottleneck == pytest.approx(brute_force(lc, bounded, opts, ranks), rel=1e-9)


def test_every_stage_count_in_one_pass_equals_one_pass_per_count() -> None:
    lc = LayerCosts.from_profile(transformer_dag(3))
    for schedule in ("gpipe", "1f1b"):
        opts = CostOptions(chunks=4, schedule=schedule)
        device = DeviceSpec("d", 300 << 20)
        counts = solve_counts(lc, device, opts, 8)
        for k, split in counts.items():
            alone = solve_split(lc, [device] * k, opts, modes="auto")
            assert (split is None) == (alone is None)
            if split is not None and alone is not None:
                assert (split.assignment, split.modes) == (alone.assignment, alone.modes)
                assert split.bottleneck == alone.bottleneck
    with pytest.raises(ValueError, match="gpipe, 1f1b"):
        solve_counts(lc, device, CostOptions(schedule="interleaved1f1b"), 4)


def test_only_the_stages_where_memory_binds_recompute() -> None:
    # heavy activations in cheap early layers, light ones late: the first stage cannot keep 8
    # micro-batches, the others can; recomputing everywhere would slow the bottleneck
    prof = chain_profile([0.3] * 2 + [1.0] * 6, saved_bytes=[64 << 20] * 2 + [1 << 20] * 6,
                         output_bytes=1 << 10)
    lc = LayerCosts.from_profile(prof)
    opts = CostOptions(chunks=8, optimizer="none", bandwidth=None)
    split = solve_split(lc, [DeviceSpec(f"d{s}", 200 << 20) for s in range(4)], opts, modes="auto")
    assert split is not None and split.modes[0] != "never" and split.modes[1:] == ["never"] * 3
    never = solve_split(lc, [DeviceSpec(f"d{s}", 200 << 20) for s in range(4)], opts, modes="never")
    always = solve_split(lc, [DeviceSpec(f"d{s}", 200 << 20) for s in range(4)], opts, modes="always")
    assert always is not None and split.bottleneck < always.bottleneck
    assert never is None or split.bottleneck <= never.bottleneck


def test_shared_blocks_give_the_answers_of_fresh_ones() -> None:
    # the search shares one StageBlocks across limits, modes and stage positions: a tight limit
    # solved first must not leak into a roomier one solved next (nor the other way round)
    lc = LayerCosts.from_profile(random_chain(40, 7))
    opts = CostOptions(chunks=4, schedule="1f1b")
    shared = StageBlocks(lc, opts)
    for limit in (40 << 20, None, 25 << 20, 80 << 20):
        devices = [DeviceSpec(f"d{s}", limit) for s in range(4)]
        for modes in ("auto", "never", "always"):
            fresh = solve_split(lc, devices, opts, modes=modes)
            again = solve_split(lc, devices, opts, modes=modes, blocks=shared)
            assert (fresh is None) == (again is None)
            if fresh is not None and again is not None:
                assert (again.assignment, again.modes, again.bottleneck) == (
                    fresh.assignment, fresh.modes, fresh.bottleneck)


@pytest.mark.parametrize("seed", range(6))
def test_per_stage_modes_match_brute_force_where_the_loss_binds_the_last_stage(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 7)), int(rng.integers(2, 4))
    lc, _ = with_loss(seed, n)  # [Note: the loss's memory], on ranks for odd seeds
    opts = CostOptions(chunks=int(rng.integers(2, 6)), schedule=("gpipe", "1f1b")[seed % 2])
    limit = int(least_memory(lc, k, CostOptions(opts.chunks, "always", schedule=opts.schedule))
                * rng.uniform(1.0, 1.5))
    devices = [DeviceSpec(f"d{s}", limit) for s in range(k)]
    expected = brute_force(lc, devices, opts)
    split = solve_split(lc, devices, opts, modes="auto")
    assert np.isfinite(expected) and split is not None
    assert split.bottleneck == pytest.approx(expected, rel=1e-9)
    chosen = CostOptions(opts.chunks, tuple(split.modes), schedule=opts.schedule)
    assert all(c.memory_bytes <= limit for c in stage_costs(lc, split.assignment, devices, chosen))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("binds", ["backward", "receive buffers"])
def test_per_stage_modes_match_brute_force_where_the_backward_or_the_buffers_bind(binds: str, seed: int) -> None:
    # [Note: the backward's memory]; [Note: receive buffers] (on ranks)
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(4, 7)), int(rng.integers(2, 4))
    lc, _ = with_backward(seed, n) if binds == "backward" else with_buffers(seed, n)
    opts = CostOptions(chunks=int(rng.integers(2, 6)), schedule=("gpipe", "1f1b")[seed % 2],
                       optimizer=("sgd", "momentum" if binds == "backward" else "adamw")[seed % 2])
    limit = int(least_memory(lc, k, CostOptions(opts.chunks, "always", opts.optimizer, schedule=opts.schedule))
                * rng.uniform(1.0, 1.5))
    devices = [DeviceSpec(f"d{s}", limit) for s in range(k)]
    expected = brute_force(lc, devices, opts)
    split = solve_split(lc, devices, opts, modes="auto")
    assert np.isfinite(expected) and split is not None
    assert split.bottleneck == pytest.approx(expected, rel=1e-9)
    chosen = CostOptions(opts.chunks, tuple(split.modes), opts.optimizer, schedule=opts.schedule)
    assert all(c.memory_bytes <= limit for c in stage_costs(lc, split.assignment, devices, chosen))
