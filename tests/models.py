"""Small models shared by the tests (bundled examples live in autopipe.examples)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Chain(nn.Module):
    """A plain chain of Linear+ReLU layers of given widths."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 16, 16, 4)) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:], strict=False):
            mods += [nn.Linear(w_in, w_out), nn.ReLU()]
        self.net = nn.Sequential(*mods[:-1])

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Skip(nn.Module):
    """A skip connection that crosses any cut placed between a and c."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.c = nn.Linear(dim, dim)
        self.d = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        y = self.c(torch.relu(self.b(h)))
        return self.d(y + h)


class MultiIO(nn.Module):
    """Two inputs, a non-tensor value crossing layers and a dict output."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.x_proj = nn.Linear(dim, dim)
        self.y_proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        n = x.size(1)
        h = self.x_proj(x) + self.y_proj(y)
        h = h.reshape(-1, n)
        return {"logits": self.out(h), "hidden": h}


class Dropouty(nn.Module):
    """Dropout between layers, to test that recomputation replays the same masks."""

    def __init__(self, dim: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.l2 = nn.Linear(dim, dim)
        self.l3 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.l3(F.relu(self.l2(self.drop(F.relu(self.l1(x))))))


class BNNet(nn.Module):
    """BatchNorm between convolutions, for the deferred-BatchNorm tests."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.c1(x)))
        x = F.relu(self.bn2(self.c2(x)))
        return self.head(x.mean(dim=(2, 3)))


class Untraceable(nn.Module):
    """Data-dependent Python control flow: neither fx nor export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l(x)
        if h.sum().item() > 0:  # data-dependent branch
            return h * 2
        return h


def tiny_gpt2() -> nn.Module:
    """HuggingFace GPT-2 built from a tiny config (no weights downloaded), dropout off.

    Skips the calling test when transformers is not installed.
    """
    import pytest

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def tiny_llama(meta: bool = False) -> nn.Module:
    """HuggingFace Llama (2 layers, hidden 32, vocab 64, grouped-query attention) from a config,
    built on the meta device with ``meta=True``. Skips the calling test without transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg)
    return transformers.LlamaForCausalLM(cfg)


# --- factories for `autopipe profile package.module:factory` (tests/app/test_cli_profile.py) --------
NOT_CALLABLE = 3


def make_chain(batch_size: int = 8) -> tuple[nn.Module, Tensor]:
    """A factory taking the batch size: returns (model, inputs)."""
    return Chain(), torch.randn(batch_size, 8)


def make_fixed_batch() -> tuple[nn.Module, tuple[Tensor]]:
    """A factory ignoring the batch size: always 4 rows."""
    return Chain(), (torch.randn(4, 8),)


def make_hf_batch(batch_size: int = 8) -> tuple[nn.Module, dict[str, Tensor]]:
    """A factory returning an HF model and a keyword batch (tests/assemble/test_hf_batches.py's
    one-layer Llama and its padded, partly ignored batch)."""
    from tests.assemble.test_hf_batches import _llama, causal_batch

    torch.manual_seed(0)
    return _llama(), causal_batch(rows=batch_size)


def make_wrong() -> int:
    return 3


def make_raises() -> nn.Module:
    raise RuntimeError("boom\nsecond line")


def make_link_bound(batch_size: int = 4096) -> tuple[nn.Module, tuple[Tensor]]:
    """Four Linear(512, 512) + ReLU and a head: every cut carries a micro-batch's whole 512-wide
    activation (1 MiB at 512 rows) for ~20 ms of compute, so the link decides whether two stages
    pay (tests/app/test_two_hosts.py): they do on a veth, by 1.25x even where a busy host measured
    its latency at 1.8 ms (128 wide, two stages lost there; 512 wide, from about 4.3 ms), and
    lose 8x behind a 100 Mbit/s rate limit."""
    torch.manual_seed(0)
    return Chain((512, 512, 512, 512, 512, 4)), (torch.randn(batch_size, 512),)
