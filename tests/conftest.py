from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch


def skip_if_no_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """A CUDA test: marked ``cuda`` (``pytest -m cuda`` runs just these, as
    benchmarks/gpu_check.sh does) and skipped cleanly on a machine without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))

# Keep the suite fast and deterministic on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed() -> Iterator[int]:
    """Seed every RNG before each test so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield 0
