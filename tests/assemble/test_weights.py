"""pipeline(meta model, weights=...): stages materialised one at a time equal the plain model."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

import autopipe
from autopipe.core.plan import Plan
from autopipe.errors import BuildError
from autopipe.examples import TinyGPT
from autopipe.frontend.building.weights import WeightsError, save_sharded
from tests.models import tiny_llama

CHUNKS = 4
DEVICES = ["cpu"] * 3  # the plans are made for where the tests run them: no placement warning


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def _meta(**kw: Any) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(layers=2, **kw)


@pytest.fixture(scope="module")
def case() -> tuple[TinyGPT, Tensor, Tensor, Plan]:
    torch.manual_seed(0)
    real = TinyGPT(layers=2)
    ids, target = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))
    prof = autopipe.profile(real, (ids,), chunks=CHUNKS, repeats=1, warmup=0, progress=False)
    return real, ids, target, autopipe.partition(prof, devices=DEVICES, chunks=CHUNKS)


def _weights(real: nn.Module, fmt: str, folder: Path) -> Any:
    state = {k: v.detach().clone() for k, v in real.state_dict().items()}
    del state["head.weight"]  # a tied head is stored once, as HuggingFace stores it
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
        return folder / "model.safetensors"
    if fmt == "sharded":
        keys = sorted(state)
        return save_sharded([{k: state[k] for k in keys[:5]}, {k: state[k] for k in keys[5:]}],
                            folder)
    torch.save(state, folder / "model.pt")
    return folder / "model.pt"


@pytest.mark.parametrize("recompute", ["always", "except_last", "never"])
@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "torch"])
def test_meta_model_with_weights_equals_the_plain_model(
    case: tuple[TinyGPT, Tensor, Tensor, Plan], tmp_path: Path, fmt: str, recompute: str
) -> None:
    real, ids, target, plan = case
    plan = dataclasses.replace(plan, recompute=recompute)  # the same split, run in this mode
    ref = TinyGPT(layers=2)
    ref.load_state_dict(real.state_dict())
    meta = _meta()
    pipe = autopipe.pipeline(meta, (ids,), devices=DEVICES, chunks=CHUNKS, plan=plan,
                             weights=_weights(real, fmt, tmp_path))
    assert pipe.recompute_modes == [recompute] * 3
    assert not any(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    assert meta.head.weight is meta.tok.weight
    loss = _loss(pipe(ids), target)
    loss.backward()
    want = torch.stack([_loss(ref(x), y) for x, y in zip(ids.tensor_split(CHUNKS),
                                                         target.tensor_split(CHUNKS), strict=True)])
    want.mean().backward()
    torch.testing.assert_close(loss, want.mean())
    grads = dict(meta.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    state = pipe.state_dict()
    assert sorted(state) == sorted(ref.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value)


def test_a_real_model_takes_its_weights_from_the_file(
    case: tuple[TinyGPT, Tensor, Tensor, Plan], tmp_path: Path
) -> None:
    real, ids, _, plan = case
    torch.manual_seed(1)
    other = TinyGPT(layers=2)  # another initialisation: the file must overwrite it
    assert not torch.equal(other.tok.weight, real.tok.weight)
    pipe = autopipe.pipeline(other, (ids,), devices=DEVICES, chunks=CHUNKS, plan=plan,
                             weights=_weights(real, "safetensors", tmp_path))
    torch.testing.assert_close(pipe(ids), real(ids))


def test_without_weights_the_pipeline_says_it_initialised(
    case: tuple[TinyGPT, Tensor, Tensor, Plan]
) -> None:
    _, ids, _, plan = case

    def init(module: nn.Module) -> None:
        if isinstance(module, TinyGPT):
            nn.init.normal_(module.pos, std=0.02)
        else:
            module.reset_parameters()  # type: ignore[operator]

    with pytest.warns(UserWarning, match=r"the model is on the meta device and no weights= were "
                                         r"given: \d+ module\(s\) were initialised"):
        pipe = autopipe.pipeline(_meta(), (ids,), devices=DEVICES, chunks=CHUNKS, plan=plan,
                                 init=init)
    assert torch.isfinite(pipe(ids)).all()
    with pytest.raises(BuildError, match=r"module '<model>' \(TinyGPT\) has tensors on the meta "
                                         r"device and no reset_parameters\(\); pass init=fn"):
        autopipe.pipeline(_meta(), (ids,), devices=DEVICES, chunks=CHUNKS, plan=plan)


@pytest.mark.parametrize(("other", "match"), [
    ({"layers": 3}, r"has \d+ key\(s\) the model does not, e.g. \['blocks.2"),
    ({"dim": 32}, r"'pos' is \[1, 64, 32\] in the file but \[1, 64, 64\] in the model"),
])
def test_weights_of_another_model_are_refused_in_one_line(
    case: tuple[TinyGPT, Tensor, Tensor, Plan], tmp_path: Path, other: dict[str, int], match: str
) -> None:
    _, ids, _, plan = case
    state = TinyGPT(**{"layers": 2, **other}).state_dict()
    save_file({k: v.contiguous() for k, v in state.items() if k != "head.weight"},
              str(tmp_path / "other.safetensors"))
    meta = _meta()
    with pytest.raises(WeightsError, match=match) as err, warnings.catch_warnings():
        warnings.simplefilter("error")
        autopipe.pipeline(meta, (ids,), devices=DEVICES, chunks=CHUNKS, plan=plan,
                          weights=tmp_path / "other.safetensors")
    assert "\n" not in str(err.value)
    assert all(p.is_meta for p in meta.parameters())  # refused before anything was allocated


@pytest.mark.compat
def test_a_meta_hf_llama_from_its_weights_equals_the_plain_model(tmp_path: Path) -> None:
    """Stages of a meta-built HF Llama made real from a safetensors file, its nested graphs
    (transformers 5.17's rotary body: [Note: nested graphs]) moved to the device too."""
    torch.manual_seed(0)
    real = tiny_llama()
    save_file({k: v.detach().clone() for k, v in real.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    meta = tiny_llama(meta=True)
    ids = torch.randint(0, 64, (4, 8))
    with warnings.catch_warnings():
        # only rotary inv_freq, in no weights file, is initialised: no warning says "no weights"
        warnings.filterwarnings("error", message="autopipe: the model is on the meta device")
        pipe = autopipe.pipeline(meta, (ids,), devices=["cpu", "cpu"], chunks=2,
                                 weights=tmp_path / "model.safetensors", init=meta._init_weights)
    torch.testing.assert_close(pipe(ids).logits, real(ids).logits)
