"""Leave a model exactly as it was after measuring it.

[Note: profiling leaves the model as it was] Profiling is training-mode work on a user's live
model: the model is switched to ``train()``, moved to ``device`` if needed, and run forward and
backward many times. Afterwards every module's mode, every parameter's device and ``.grad``,
every buffer (BatchNorm running statistics) and the RNG state are exactly what they were.
No optimizer step is ever taken, so parameter values never change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["preserved"]


@contextlib.contextmanager
def preserved(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Train mode on ``device`` inside; modes, devices, grads, buffers and RNG restored after.

    See [Note: profiling leaves the model as it was].
    """
    modules = list(model.modules())
    modes = [(m, m.training) for m in modules]
    params = list({id(p): p for p in model.parameters()}.values())
    grads = [(p, p.grad, p.device) for p in params]
    buffers = [
        (m, name, b, b.detach().clone())
        for m in modules for name, b in m._buffers.items() if b is not None
    ]
    cuda = sorted({int(t.device.index or 0) for t in [*params, *(b for *_, b, _ in buffers)]
                   if t.device.type == "cuda"} | ({int(device.index or 0)} if device.type == "cuda" else set()))
    with torch.random.fork_rng(devices=cuda):
        try:
            for p in params:
                p.grad = None
            model.train()
            model.to(device)
            yield
        finally:
            with torch.no_grad():
                for p, grad, dev in grads:
                    if p.device != dev:
                        p.data = p.data.to(dev)
                    p.grad = grad
                for m, name, b, saved in buffers:
                    m._buffers[name] = b
                    b.copy_(saved)
            for m, mode in modes:
                m.training = mode
