"""[Note: what a consumer reads]: a cut carries what the consumers beyond it read of a layer."""

from __future__ import annotations

import pandas as pd

from autopipe.core.cost import DeviceSpec, LayerCosts, stage_costs
from autopipe.core.cost_options import CostOptions
from autopipe.core.profile_table import Profile
from autopipe.core.recomputed_layers import choose, segment_freed


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
    picked = choose(costs, [2, 3, 4], 1200)  # the chooser's running sums agree
    assert segment_freed(costs, picked) >= 1200
