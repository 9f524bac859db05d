from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autopipe import AutopipeError
from autopipe.core.profile_table import Profile, fingerprint_mismatch
from autopipe.examples import EXAMPLES, TinyGPT, get_example
from autopipe.frontend.profiling.harness.inputs import micro_batch
from autopipe.frontend.tracing.graph import trace

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_one_step(name: str) -> None:
    ex = get_example(name, batch_size=3)
    assert ex.name == name
    assert all(x.shape[0] == 3 for x in ex.inputs) and ex.target.shape[0] == 3
    loss = ex.loss_fn(ex.model(*ex.inputs), ex.target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in ex.model.parameters())


def test_examples_are_seeded_and_do_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = get_example("gpt", 2), get_example("gpt", 2)
    assert torch.rand(1) == before  # get_example forks the RNG
    assert torch.equal(a.inputs[0], b.inputs[0])
    assert torch.equal(a.model.tok.weight, b.model.tok.weight)
    assert not torch.equal(a.model.tok.weight, get_example("gpt", 2, seed=1).model.tok.weight)


def test_gpt_head_is_tied_and_mlp_is_uneven() -> None:
    gpt = get_example("gpt", 2).model
    assert gpt.head.weight is gpt.tok.weight
    linears = [m for m in get_example("mlp", 2).model.modules() if isinstance(m, torch.nn.Linear)]
    flops = [m.in_features * m.out_features for m in linears]
    assert max(flops) / min(flops) >= 16


@pytest.mark.parametrize(
    "name,batch,match", [("resnet", 2, "unknown example 'resnet'"), ("mlp", 0, "batch_size")]
)
def test_bad_arguments(name: str, batch: int, match: str) -> None:
    with pytest.raises(AutopipeError, match=match):
        get_example(name, batch)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpt_starts_at_the_loss_of_a_uniform_guess_and_learns(seed: int) -> None:
    ex = get_example("gpt", batch_size=8, seed=seed)
    vocab = ex.model.tok.num_embeddings
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        loss = ex.loss_fn(ex.model(*ex.inputs), ex.target)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[0] == pytest.approx(math.log(vocab), rel=0.10)  # ln(256) = 5.55, not 56
    assert losses[-1] < losses[0] - 0.1 and losses == sorted(losses, reverse=True)


def test_gpt_init_is_gpt2s() -> None:
    model = TinyGPT(layers=6)
    assert model.head.weight is model.tok.weight
    assert model.tok.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].fc1.weight.std().item() == pytest.approx(0.02, rel=0.1)
    scaled = 0.02 / math.sqrt(2 * 6)  # residual projections shrink with depth
    assert model.blocks[0].proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert model.blocks[5].fc2.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert all(torch.all(m.bias == 0) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)


@pytest.mark.parametrize("folder", ["", "cuda"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_profiles_match_the_examples(name: str, folder: str) -> None:
    """profiles/NAME.* (this machine's CPU) and profiles/cuda/NAME.* (an H200, by
    benchmarks/gpu_check.sh) were measured on these models: a fresh trace has their fingerprint."""
    prof = Profile.load(PROFILES / folder / f"{name}.csv")
    assert (prof.meta["device_type"] == "cuda") == (folder == "cuda")
    ex = get_example(name, batch_size=int(prof.meta["batch_size"]))
    inputs, _, micro = micro_batch(ex.inputs, int(prof.meta["chunks"]))
    assert micro == prof.meta["micro_batch_size"]
    graph = trace(ex.model, inputs)
    assert graph.layers == prof.layers
    assert fingerprint_mismatch(prof.fingerprint, graph.fingerprint) is None


@pytest.mark.slow
def test_the_huggingface_example_trains_saves_and_loads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """examples/huggingface.py as docs/guide/huggingface.md runs it: HF batches through the
    pipeline, save_pretrained, and from_pretrained computing the pipeline's logits."""
    import runpy
    import sys

    pytest.importorskip("transformers")
    script = Path(__file__).resolve().parents[1] / "examples" / "huggingface.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "2", "--out", str(tmp_path / "out")])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("loss ") == 2 and "step 2/2" in out
    assert f"saved {tmp_path / 'out' / 'model.safetensors.index.json'}" in out
    assert "the same logits as the pipeline" in out
    assert {"config.json", "model.safetensors.index.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
