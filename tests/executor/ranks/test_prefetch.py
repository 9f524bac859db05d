"""[Note: yield after sends]: a CPU rank gives its core to gloo's I/O thread after posting."""

from __future__ import annotations

import os

import pytest
import torch

from executor.ranks import prefetch


@pytest.mark.skipif(not hasattr(os, "sched_yield"), reason="needs os.sched_yield")
def test_a_cpu_rank_yields_once_after_posting_and_a_gpu_rank_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []
    monkeypatch.setattr(prefetch.os, "sched_yield", lambda: calls.append(None))
    prefetch.after_sends(torch.device("cpu"))
    assert len(calls) == 1
    prefetch.after_sends(torch.device("meta"))
    prefetch.after_sends(torch.device("cuda", 0))
    assert len(calls) == 1
