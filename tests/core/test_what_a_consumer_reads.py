"""[Note: what a consumer reads]: a cut carries what the consumers beyond it read of a layer."""

from __future__ import annotations

import pandas as pd

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.core.recomputed_layers import choose_segments, segment_freed


def _embedding_and_mask() -> LayerCosts:
    # e makes a 1000-byte embedding that a reads and a 10-byte mask that c and d read (HF
    # Llama's embedding layer); a -> b -> c -> d carry 100 bytes each
    df = pd.DataFrame({"layer": ["e", "a", "b", "c", "d"], "fwd_ms": [1.0] * 5, "bwd_ms": [1.0] * 5,
                       "param_bytes": [0] * 5, "output_bytes": [1000, 100, 100, 100, 100],
                       "saved_bytes": [0, 1000, 500, 600, 700]})
    edges = [("e", "a", 1000), ("e", "c", 10), ("e", "d", 10), ("a", "b", 100), ("b", "c", 100),
             ("c", "d", 100)]
    return LayerCosts.from_profile(Profile(df, edges, {}))


def test_a_cut_carries_the_most_one_consumer_beyond_it_reads() -> None:
    costs = _embedding_and_mask()
    assert costs.value_bytes[0] == 1000  # the layer's largest value
    # cut i lies before layer i: before a the embedding crosses, after a only the mask does
    assert costs.cut_bytes().tolist() == [0, 1000, 100 + 10, 100 + 10, 100 + 10, 0]
    options = CostOptions(chunks=1, recompute="never", optimizer="none", bandwidth=None)
    devices = [DeviceSpec("x"), DeviceSpec("y")]
    for cut in (2, 3, 4):
        first, second = stage_costs(costs, [0] * cut + [1] * (5 - cut), devices, options)
        assert first.output_bytes == second.input_bytes == costs.cut_bytes()[cut] == 110
    first, _ = stage_costs(costs, [0, 1, 1, 1, 1], devices, options)
    assert first.output_bytes == 1000


def test_a_segment_keeps_a_copy_of_what_its_layers_read() -> None:
    costs = _embedding_and_mask()
    # b..c recomputed: it keeps a copy of a's output (100) and of e's mask (10), not e's embedding
    assert segment_freed(costs, [2, 3]) == 500 + 600 - 100 - 10
    runs = choose_segments(costs, [2, 3, 4], 1200)  # the chooser's running sums agree
    assert sum(segment_freed(costs, run) for run in runs) >= 1200


def _random_dag(seed: int, n: int = 9) -> LayerCosts:
    """Each layer read by up to three later ones (always its next), each read a different size."""
    import numpy as np

    rng = np.random.default_rng(seed)  # its own generator
    names = [f"l{i}" for i in range(n)]
    edges = []
    for u in range(n - 1):
        later = {u + 1, *rng.choice(np.arange(u + 1, n), size=min(2, n - u - 1), replace=False).tolist()}
        edges += [(names[u], names[v], int(rng.integers(1, 1000))) for v in sorted(later)]
    df = pd.DataFrame({"layer": names, "fwd_ms": [1.0] * n, "bwd_ms": [1.0] * n, "param_bytes": [0] * n,
                       "output_bytes": [1000] * n, "saved_bytes": [0] * n})
    return LayerCosts.from_profile(Profile(df, edges, {}))


def test_the_dps_cut_and_a_stages_crossings_agree_on_every_contiguous_split() -> None:
    # one rule written twice, for two inputs: cut_bytes() by position (the DPs), _crossings by
    # stage (stage_costs, any assignment); on a contiguous split they must give the same bytes
    import itertools

    options = CostOptions(chunks=1, recompute="never", optimizer="none", bandwidth=None)
    for costs in (_embedding_and_mask(), *(_random_dag(seed) for seed in range(6))):
        n, at = len(costs), costs.cut_bytes()
        for k in (2, 3, 4):
            for cuts in itertools.combinations(range(1, n), k - 1):
                assignment = [sum(i >= c for c in cuts) for i in range(n)]
                stages = stage_costs(costs, assignment, [DeviceSpec(f"d{s}") for s in range(k)], options)
                assert [s.output_bytes for s in stages[:-1]] == [int(at[c]) for c in cuts], cuts
                assert [s.input_bytes for s in stages[1:]] == [int(at[c]) for c in cuts], cuts
