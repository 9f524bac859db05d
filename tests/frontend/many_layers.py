"""Models that trace to many tiny layers: a Python loop over time steps, and a small HF Mamba."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from autopipe.frontend.tracing.granularity import MAX_LAYERS_PER_MODULE


class FineBlock(nn.Module):
    """A block of many small ops around two leaf modules: too fine to keep op by op."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        for _ in range(MAX_LAYERS_PER_MODULE):
            h = torch.sin(h)
        return self.b(h)


class Scan(nn.Module):
    """A recurrence unrolled over ``steps`` time steps, four tiny op layers each (to, mul, add, tanh),
    the decay cast as HF models cast theirs (``.to`` of its own dtype returns the parameter)."""

    def __init__(self, steps: int, width: int = 8) -> None:
        super().__init__()
        self.steps = steps
        self.inp = nn.Linear(width, width)
        self.decay = nn.Parameter(torch.full((width,), 0.9))
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        u = self.inp(x)
        h = torch.zeros_like(u[:, 0])
        outs = []
        for t in range(self.steps):
            h = torch.tanh(h * self.decay.to(torch.float32) + u[:, t])
            outs.append(h)
        return self.out(torch.stack(outs, 1))


def tiny_mamba(blocks: int = 1) -> nn.Module:
    """HF MambaForCausalLM built from a config (no weights): hidden 64, state 16, 256 tokens."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=256, hidden_size=64, state_size=16, intermediate_size=128,
                         num_hidden_layers=blocks, use_mambapy=False)
    return MambaForCausalLM(config)
