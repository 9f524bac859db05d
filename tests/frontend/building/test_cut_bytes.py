"""[Note: what a consumer reads] in a built stage: a cut's predicted bytes are what crosses it."""

from __future__ import annotations

import torch

import autopipe
from autopipe.core.layer_costs import LayerCosts
from autopipe.frontend.building.stages import build
from tests.models import tiny_llama


def test_a_llama_cut_carries_the_mask_not_the_embedding() -> None:
    # (4 s: the one end-to-end check on a real layer of several values) the embedding layer makes the token embedding (read by the first block only) and the
    # causal mask and the sequence length (read by every block): a cut after the first block
    # carries the mask, and was charged the embedding's bytes
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 16))
    prof = autopipe.profile(model, (ids,), chunks=1, repeats=1, warmup=0, progress=False)
    graph = autopipe.trace(model, (ids,))
    names = prof.layers
    cut = names.index("model.layers.1.input_layernorm")
    plan = autopipe.Plan.from_stages(prof, [names[:cut], names[cut:]], chunks=1, recompute="never")
    first = build(model, plan, graph)[0]
    with torch.no_grad():
        out = first(ids)
    crossing = sum(v.numel() * v.element_size() for v in out if isinstance(v, torch.Tensor))
    assert plan.breakdown[0].output_bytes == plan.breakdown[1].input_bytes == crossing
    # each crossing layer charged its largest value, as before: more than crosses
    costs = LayerCosts.from_profile(prof)
    largest = sum(int(costs.value_bytes[u]) for u in range(cut) if any(c >= cut for c in costs.consumers[u]))
    assert largest - crossing == 2 * 16 * 32 * 4 - 2 * 16 * 16  # the fp32 embedding in place of the bool mask
