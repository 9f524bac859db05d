"""OneWeight: ``x * w`` with a one-element weight, a layer that is nothing but its call.

The split-backward calibration (backward_split.py: what each half of a backward pays besides
its work) and the distributed runtime's empty stages (comm.py: what a stage call costs) both
need a module whose work is nil but whose backward has an input and a weight part.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OneWeight"]


class OneWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w
