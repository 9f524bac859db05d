"""Bundled example models, used by the README quick-start, the CLI, notebooks and benchmarks.

Each example is addressable by a short name (``autopipe profile mlp``) and comes with example
inputs, a synthetic target and a loss, so it can be profiled, partitioned and trained without
any data set or download. The models are small enough to train on a laptop CPU, yet uneven
enough that an equal-layer-count split is visibly unbalanced.

[Note: no BatchNorm in examples] Micro-batching changes BatchNorm's batch statistics, so a
pipelined BatchNorm model cannot match the unpipelined one gradient for gradient. The examples
use LayerNorm / GroupNorm; BatchNorm is exercised separately by the deferred-BatchNorm tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopipe.errors import AutopipeError

__all__ = ["Example", "EXAMPLES", "get_example", "step_seed", "UnevenMLP", "ResCNN", "TinyGPT", "TinyUNet"]


class UnevenMLP(nn.Module):
    """An MLP whose layers differ by more than 16x in FLOPs: an equal split is a bad split."""

    def __init__(self, widths: tuple[int, ...] = (64, 512, 512, 64, 1024, 128, 64, 32, 10)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
            layers.append(nn.Linear(w_in, w_out))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + x)


class ResCNN(nn.Module):
    """A small ResNet-style CNN with residual skips and an in-place ReLU."""

    def __init__(self, channels: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.stem_relu = nn.ReLU(inplace=True)
        self.blocks = nn.Sequential(*[ResBlock(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem_relu(self.stem(x))
        x = self.blocks(x)
        x = torch.flatten(self.pool(x), 1)
        return self.head(x)


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention + MLP)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape[0], x.shape[1], x.shape[2]
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = att.transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(self.act(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A GPT-like language model whose output head is tied to its token embedding.

    [Note: GPT-2 initialisation] Weights start as GPT-2's do (nanoGPT's ``_init_weights``):
    every Linear and the embeddings normal(0, 0.02), biases zero, LayerNorms (1, 0), and the two
    projections that write into the residual stream (``proj``, ``fc2``) normal(0, 0.02 /
    sqrt(2 x layers)), so the stream's variance does not grow with depth. The head is the token
    embedding itself, so its logits start near zero and the first loss is close to ln(vocab),
    the loss of a uniform guess. PyTorch's defaults (Embedding normal(0, 1) seen through the
    tied head) started training at a loss of 56 for ln(256) = 5.5. Shapes are unchanged, so
    profiles of this model stay valid (tests/test_examples.py).
    """

    def __init__(
        self,
        vocab: int = 256,
        dim: int = 64,
        heads: int = 4,
        layers: int = 4,
        max_len: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        """See [Note: GPT-2 initialisation]."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            assert isinstance(block, Block)
            for residual in (block.proj, block.fc2):
                nn.init.normal_(residual.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        x = self.blocks(x)
        return self.head(self.ln_f(x))


class TinyUNet(nn.Module):
    """A two-level U-Net: long skip connections cross any pipeline cut in the middle."""

    def __init__(self, in_ch: int = 3, base: int = 8, out_ch: int = 2) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(in_ch, base, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(base, 2 * base, 3, padding=1), nn.ReLU())
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(2 * base, 4 * base, 3, padding=1), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(4 * base, 2 * base, 2, stride=2)
        self.dec2 = nn.Sequential(nn.Conv2d(4 * base, 2 * base, 3, padding=1), nn.ReLU())
        self.up1 = nn.ConvTranspose2d(2 * base, base, 2, stride=2)
        self.dec1 = nn.Sequential(nn.Conv2d(2 * base, base, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(base, out_ch, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.down(e1))
        m = self.mid(self.down(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


Batch = tuple[tuple[Tensor, ...], Tensor]  # (inputs, target)
Draw = Callable[[torch.Generator | None], Batch]


@dataclass
class Example:
    """A model with everything needed to profile and train it on synthetic data.

    [Note: a batch per step] ``inputs`` / ``target`` are step 0's batch, drawn right after the
    model from the seeded default generator (so profiles and plans made from them stay valid);
    ``batch(step)`` draws step ``step``'s from a generator seeded by (seed, step). Every run
    and every rank thus sees the same batch at the same step, and a run resumed from a
    checkpoint at step S trains on what an uninterrupted run would (``autopipe train`` /
    ``autopipe run`` call it each step)."""

    name: str
    model: nn.Module
    inputs: tuple[Tensor, ...]
    target: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    draw: Draw | None = None  # one batch from a generator (None: the seeded default one)
    seed: int = 0

    def batch(self, step: int) -> Batch:
        """Step ``step``'s (0-based) inputs and target ([Note: a batch per step]); without
        ``draw``, the one batch for every step."""
        if step == 0 or self.draw is None:
            return self.inputs, self.target
        return self.draw(torch.Generator().manual_seed(step_seed(self.seed, step)))


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s batch: a hash of (seed, step), the same on every machine (the
    CPU generator keeps 32 bits of a seed, so ``seed << 32 | step`` would not do)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}".encode(), digest_size=8).digest(), "little")


def _example(name: str, model: nn.Module, draw: Draw, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Example:
    inputs, target = draw(None)  # after the model, from the seeded default generator: step 0's
    return Example(name, model, inputs, target, loss_fn, draw)


def _mlp(batch: int) -> Example:
    def draw(g: torch.Generator | None) -> Batch:
        return (torch.randn(batch, 64, generator=g),), torch.randint(0, 10, (batch,), generator=g)

    return _example("mlp", UnevenMLP(), draw, F.cross_entropy)


def _cnn(batch: int) -> Example:
    def draw(g: torch.Generator | None) -> Batch:
        return (torch.randn(batch, 3, 16, 16, generator=g),), torch.randint(0, 10, (batch,), generator=g)

    return _example("cnn", ResCNN(), draw, F.cross_entropy)


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt(batch: int) -> Example:
    seq = 32

    def draw(g: torch.Generator | None) -> Batch:
        return (torch.randint(0, 256, (batch, seq), generator=g),), torch.randint(0, 256, (batch, seq), generator=g)

    return _example("gpt", TinyGPT(), draw, _lm_loss)


def _unet(batch: int) -> Example:
    def draw(g: torch.Generator | None) -> Batch:
        return (torch.randn(batch, 3, 32, 32, generator=g),), torch.randint(0, 2, (batch, 32, 32), generator=g)

    return _example("unet", TinyUNet(), draw, F.cross_entropy)


EXAMPLES: dict[str, Callable[[int], Example]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "gpt": _gpt,
    "unet": _unet,
}


def get_example(name: str, batch_size: int = 32, seed: int = 0) -> Example:
    """Build the bundled example ``name`` with inputs of ``batch_size`` rows, seeded (and each
    step's batch: ``ex.batch(step)``, [Note: a batch per step])."""
    if name not in EXAMPLES:
        raise AutopipeError(
            f"unknown example {name!r}; choose one of {sorted(EXAMPLES)}"
        )
    if batch_size < 1:
        raise AutopipeError(f"batch_size must be >= 1, got {batch_size}; pass batch_size=1 or more")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        ex = EXAMPLES[name](batch_size)
    ex.seed = seed
    return ex
