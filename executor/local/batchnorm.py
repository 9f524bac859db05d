"""BatchNorm whose running statistics advance once per mini-batch, as if unpipelined.

A pipelined BatchNorm normalises each micro-batch with that micro-batch's statistics (that is
inherent to micro-batching), but it must not also update its running statistics once per
micro-batch: M updates with momentum 0.1 are not one update with the mini-batch's mean and
variance. :class:`DeferredBatchNorm` (torchgpipe's idea) accumulates per-channel statistics
over the micro-batches of an iteration and :meth:`~DeferredBatchNorm.commit` applies
one update with the mini-batch statistics: the same ``running_mean`` / ``running_var`` (the
unbiased variance, as ``nn.BatchNorm*`` uses) / ``num_batches_tracked`` the plain model gets.

:class:`executor.local.gpipe.GPipe` commits after its last micro-batch ran forward, so uneven
micro-batches need no chunk count here. Recomputation (``is_recomputing()``) is not tracked.
The accumulators (count, mean and sum of squared deviations, merged per micro-batch with Chan
et al.'s parallel formula rather than torchgpipe's sum of squares, which loses precision) are
non-persistent buffers: ``state_dict`` keys are those of ``nn.BatchNorm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from executor._torch_compat import BatchNormBase as _BatchNorm
from executor.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]


class DeferredBatchNorm(_BatchNorm):
    """Normalises per micro-batch; updates running statistics per mini-batch on :meth:`commit`."""

    acc_mean: Tensor
    acc_m2: Tensor
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("acc_mean", torch.zeros(num_features), persistent=False)
        self.register_buffer("acc_m2", torch.zeros(num_features), persistent=False)
        self.count = 0

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        n = input.numel() // input.size(1)
        with torch.no_grad():
            x = input.detach().to(self.acc_mean.dtype)
            mean = x.mean(dims)
            m2 = (x - mean.view(1, -1, *[1] * (x.dim() - 2))).pow(2).sum(dims)
            total = self.count + n
            delta = mean - self.acc_mean
            self.acc_mean += delta * (n / total)
            self.acc_m2 += m2 + delta.pow(2) * (self.count * n / total)
        self.count = total

    def commit(self) -> None:
        """Apply one running-statistics update from everything tracked since the last commit."""
        if self.count == 0:
            return
        with torch.no_grad():
            self.num_batches_tracked += 1
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked.item())
            else:
                factor = self.momentum
            var = self.acc_m2 / max(self.count - 1, 1)  # unbiased, like nn.BatchNorm
            self.running_mean.mul_(1 - factor).add_(self.acc_mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        self.reset_tracking()

    def reset_tracking(self) -> None:
        """Forget what was tracked since the last commit (e.g. after a failed iteration)."""
        self.acc_mean.zero_()
        self.acc_m2.zero_()
        self.count = 0

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def from_batch_norm(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        """A deferred copy sharing ``bn``'s parameters and running-statistics buffers."""
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine)
        device = bn.running_mean.device if bn.running_mean is not None else None
        new.acc_mean = new.acc_mean.to(device)
        new.acc_m2 = new.acc_m2.to(device)
        if bn.affine:
            new.weight = bn.weight
            new.bias = bn.bias
        new.running_mean = bn.running_mean  # type: ignore[assignment]
        new.running_var = bn.running_var  # type: ignore[assignment]
        new.num_batches_tracked = bn.num_batches_tracked  # type: ignore[assignment]
        new.train(bn.training)
        return new


def convert_deferred_batch_norm(module: nn.Module) -> tuple[nn.Module, list[DeferredBatchNorm]]:
    """Replace (in place) every running-stats BatchNorm in ``module`` by a DeferredBatchNorm.

    Returns the (possibly new, if ``module`` itself is a BatchNorm) module and the deferred
    layers, which the caller must :meth:`~DeferredBatchNorm.commit` once per mini-batch.
    """
    if isinstance(module, DeferredBatchNorm):
        return module, [module]
    if isinstance(module, _BatchNorm) and module.track_running_stats:
        new = DeferredBatchNorm.from_batch_norm(module)
        return new, [new]
    found: list[DeferredBatchNorm] = []
    for name, child in list(module.named_children()):
        converted, layers = convert_deferred_batch_norm(child)
        if converted is not child:
            setattr(module, name, converted)
        found += layers
    return module, found
