"""The inputs and device of a measurement: THE micro-batch rule, device checks, moving values.

``micro_batch`` cuts an example batch to the micro-batch that profiles, plans and pipeline
graphs describe ([Note: graphs are keyed to the micro-batch] in autopipe/assemble/local.py), with the
sizes of executor.spec.microbatch_sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autopipe.errors import AutopipeError, ProfileError
from executor._torch_compat import tree_leaves, tree_map_only
from executor.spec import check_chunks, microbatch_sizes

__all__ = ["micro_batch", "other_sizes", "target_device", "to_device", "with_rows", "device_name",
           "model_dtype"]


def micro_batch(
    example_inputs: Any, chunks: int, error: type[AutopipeError] = ProfileError
) -> tuple[tuple[Any, ...], int, int]:
    """Slice a batch to one micro-batch: returns (inputs, batch size, micro-batch size).

    Every tensor input with a batch dimension is cut to its first ``ceil(batch / chunks)``
    rows along dim 0 (copies), the size of the largest micro-batch ``chunks`` will make. This is
    THE micro-batch rule: the profile, the plan's fingerprint and the pipeline's graph all use it
    ([Note: graphs are keyed to the micro-batch] in autopipe/assemble/local.py). ``error`` is the class
    raised on bad input, so each caller reports in its own terms.
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    try:
        check_chunks(chunks)
    except ValueError as err:
        raise error(str(err)) from None
    sizes = {int(t.shape[0]) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not sizes:
        raise error(
            "example inputs hold no tensor with a batch dimension (dim 0); pass at least one "
            "batched tensor"
        )
    if len(sizes) > 1:
        raise error(
            f"example input tensors disagree on the batch size (dim 0 sizes {sorted(sizes)}); "
            "every batched input must have the same dim 0"
        )
    batch = sizes.pop()
    try:
        micro = microbatch_sizes(batch, chunks)[0]
    except ValueError as err:
        raise error(str(err)) from None

    def cut(t: torch.Tensor) -> torch.Tensor:  # copied: in-place layers must not write the batch
        return (t[:micro] if t.dim() > 0 else t).clone()

    return tuple(tree_map_only(torch.Tensor, cut, inputs)), batch, micro


def target_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ProfileError(f"device {device!r} is not a torch device ({err}); use 'cpu' or 'cuda'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ProfileError(f"device {dev} cannot be profiled: only 'cpu' and 'cuda[:N]' are timed; use one of those")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ProfileError(
                f"device {str(device)!r} requested but CUDA is not available on this machine; use 'cpu'"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ProfileError(
                f"device cuda:{index} does not exist ({torch.cuda.device_count()} CUDA devices); "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        dev = torch.device("cuda", index)
    return dev


def to_device(value: Any, device: torch.device) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def other_sizes(sizes: Sequence[int] | None, micro: int) -> list[int]:
    """The extra micro-batch sizes of ``profile(micro_batch_sizes=)``, checked, without ``micro``."""
    if sizes is None:
        return []
    bad = [r for r in sizes if isinstance(r, bool) or not isinstance(r, int) or r < 1]
    if bad or isinstance(sizes, str):
        raise ProfileError(f"micro_batch_sizes must be row counts >= 1, got {sizes!r}; "
                           "pass e.g. [1, 2, 4, 8]")
    return sorted(set(sizes) - {micro})


def with_rows(example_inputs: Any, rows: int) -> tuple[Any, ...]:
    """Every batched tensor of the example inputs at ``rows`` rows (repeated when it has fewer)."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        times = -(-rows // t.shape[0])
        return torch.cat([t] * times)[:rows].clone() if times > 1 else t[:rows].clone()

    return tuple(tree_map_only(torch.Tensor, cut, inputs))


def device_name(dev: torch.device) -> str:
    """The name a profile records for ``dev``: the GPU's model, or "cpu"."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def model_dtype(model: nn.Module) -> str:
    """The dtype of ``model``'s first floating parameter ("float32"), else torch's default."""
    floats = (p.dtype for p in model.parameters() if p.is_floating_point())
    return str(next(floats, torch.get_default_dtype())).replace("torch.", "")
