"""`autopipe profile` says what [Note: automatic granularity] grouped."""

from __future__ import annotations

import torch
from torch import nn

import autopipe
from autopipe.app.profile_job import summary_table
from tests.frontend.many_layers import FineBlock


def test_the_summary_names_the_grouped_layers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), FineBlock(), nn.Linear(8, 8))
    prof = autopipe.profile(model, (torch.randn(4, 8),), chunks=2, repeats=1, warmup=0)
    assert prof.meta["grouped"] == {"traced_layers": 36, "merged": {"1": 34}}
    assert "36 traced layers grouped into 3: 1 (34) are one layer each;" in summary_table(prof)
    fine = autopipe.profile(model, (torch.randn(4, 8),), chunks=2, repeats=1, warmup=0, leaf_modules=[])
    assert "grouped" not in fine.meta and "grouped" not in summary_table(fine)
