"""benchmarks/step_split.py runs, and its tables say what they measured; its torch peer
(benchmarks/torch_moves.py) splits as torch's own tests say auto_partition does."""

from __future__ import annotations

import pytest

from autopipe.solvers.synthetic import torch_workloads
from benchmarks import step_split
from benchmarks.torch_moves import minmax_blocks, reachable


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.split("|")[1:-1]]


def test_step_split_tables_run_tiny() -> None:
    out = step_split.main(["--chains", "1", "--workloads", "2"])
    command, machine, _, head, _, *rest = out.splitlines()
    assert command == "python benchmarks/step_split.py --chains 1 --workloads 2" and "(simulated)" in machine
    assert head.startswith("| schedule | chains | default: slower, worst")
    chains, rest = rest[:len(step_split.LAYOUTS)], rest[len(step_split.LAYOUTS):]
    assert [_cells(r)[0] for r in chains] == list(step_split.LAYOUTS)
    for row in chains:  # the default and "step" found the fastest split of the chain
        cells = _cells(row)
        assert cells[2] == cells[3] == "0, 0.00%"
    blank, head, _, *workloads, blank2, note = rest
    assert blank == blank2 == "" and head.startswith("| workload | schedule | stages | fastest ms | default |")
    names = [w.name for w in torch_workloads()[:2]]
    assert [(_cells(r)[0].rstrip(" *"), _cells(r)[1]) for r in workloads] == [
        (n, s) for n in names for s in ("gpipe", "1f1b")]  # 8 layers: 8 stages would be one split
    assert note.startswith("* a schedule torch's tests")
    for row in workloads:
        cells = _cells(row)
        assert cells[4] == cells[5] == "0.00%" and float(cells[3]) > 0


def _as_lists(blocks: tuple[tuple[int, int], ...]) -> list[list[int]]:
    return [list(range(a, b)) for a, b in blocks]


@pytest.mark.parametrize(("fwd", "stages", "base", "best"), [
    # torch's test_optimize_partition_model_layers_rebalances_prefix_after_shift
    ([8, 11, 2, 1, 18, 5, 4, 11], 4, [[0], [1, 2, 3], [4], [5, 6, 7]], [[0, 1, 2], [3, 4], [5], [6, 7]]),
    # test_optimize_partition_model_layers_for_1f1b
    ([1170, 2846, 1146, 4254, 2199, 1289, 6888, 2312], 4, [[0, 1, 2], [3, 4, 5], [6], [7]],
     [[0, 1, 2, 3], [4, 5], [6], [7]]),
    # test_optimize_partition_model_layers_for_interleaved_zero_bubble
    ([3084, 4757, 4139, 1960, 6283, 2830, 3507, 6252, 6451, 2029, 5175, 5108], 8,
     [[0, 1], [2, 3], [4], [5, 6], [7], [8], [9, 10], [11]], [[0, 1], [2, 3], [4], [5, 6], [7], [8], [9], [10, 11]]),
])
def test_the_torch_peer_starts_where_torch_does_and_reaches_its_answer(
        fwd: list[int], stages: int, base: list[list[int]], best: list[list[int]]) -> None:
    work = [3.0 * f for f in fwd]  # forward + twice the forward
    assert _as_lists(minmax_blocks(work, stages)) == base
    reached = [_as_lists(b) for b in reachable(work, stages)]
    assert reached[0] == base and best in reached
