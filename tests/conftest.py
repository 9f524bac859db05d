from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

skip_if_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Keep the suite fast and deterministic on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed() -> Iterator[int]:
    """Seed every RNG before each test so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield 0
