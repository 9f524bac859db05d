"""Resolve a MODEL argument of the command line into a model and one batch of inputs.

    load_model("mlp", batch_size=32)                          # a bundled example
    load_model("mypkg.models:make", batch_size=32)            # factory -> (model, inputs)
    load_model("mypkg.models:Net", 32, input_shape=(3, 32, 32))  # factory -> model; random inputs

A factory is any callable ``package.module:name``. It is called with ``batch_size=B`` when it
has a ``batch_size`` parameter, else with no arguments, and returns either ``(model, inputs)``,
an object with ``.model`` and ``.inputs`` (like :class:`autopipe.examples.Example`), or a bare
``nn.Module``, in which case ``input_shape`` (one sample's shape, without the batch dimension)
makes a random float batch.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopipe.errors import ProfileError, first_line

__all__ = ["LoadedModel", "load_model"]


@dataclass
class LoadedModel:
    name: str  # short name: the example name or the factory's name
    model: nn.Module
    inputs: tuple[Any, ...]


def _factory(spec: str) -> Any:
    from autopipe.examples import EXAMPLES

    if ":" not in spec:
        raise ProfileError(
            f"model {spec!r} is neither a bundled example ({', '.join(sorted(EXAMPLES))}) nor "
            "'package.module:factory'; pass e.g. 'mlp' or 'mypkg.models:make_model'"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ProfileError(f"model {spec!r} must be 'package.module:factory' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ProfileError(
            f"cannot import module {module_name!r} of model {spec!r} ({first_line(err)}); "
            "check the name and that it is on PYTHONPATH"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ProfileError(
                f"module {module_name!r} has no attribute {attr!r}; name a factory defined there"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ProfileError(
            f"{spec!r} is a {type(obj).__name__}, not callable; name a function or class that "
            "returns a model (and inputs)"
        )
    return obj


def _random_batch(batch_size: int, input_shape: Sequence[int]) -> tuple[torch.Tensor]:
    if any(d < 1 for d in input_shape):
        raise ProfileError(f"input shape {list(input_shape)} has a non-positive dimension; use sizes >= 1")
    return (torch.randn(batch_size, *input_shape),)


def load_model(
    spec: str, batch_size: int | None = None, *, input_shape: Sequence[int] | None = None
) -> LoadedModel:
    """Build the model named by ``spec`` with a batch of ``batch_size`` rows (default 32)."""
    from autopipe.examples import EXAMPLES, get_example

    if batch_size is not None and batch_size < 1:
        raise ProfileError(f"batch size must be >= 1, got {batch_size}; pass --batch-size 1 or more")
    if spec in EXAMPLES:
        ex = get_example(spec, batch_size or 32)
        return LoadedModel(spec, ex.model, ex.inputs)
    factory = _factory(spec)
    try:
        takes_batch = "batch_size" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        takes_batch = False
    try:
        made = factory(batch_size=batch_size or 32) if takes_batch else factory()
    except Exception as err:  # the user's code: report it in one line
        raise ProfileError(f"factory {spec!r} raised {first_line(err)}; fix the factory") from None
    name = spec.partition(":")[2].split(".")[-1]
    model, inputs = _unpack(spec, made)
    if inputs is None:
        if input_shape is None:
            raise ProfileError(
                f"factory {spec!r} returned a model without inputs; pass --input-shape (one "
                "sample's shape, e.g. 3,32,32) or return (model, inputs)"
            )
        inputs = _random_batch(batch_size or 32, input_shape)
    elif batch_size is not None and not takes_batch:
        got = next((int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim()), None)
        if got is not None and got != batch_size:
            raise ProfileError(
                f"factory {spec!r} returned inputs of batch {got} but --batch-size is {batch_size}; "
                "give the factory a batch_size parameter or drop --batch-size"
            )
    return LoadedModel(name, model, inputs)


def _unpack(spec: str, made: Any) -> tuple[nn.Module, tuple[Any, ...] | None]:
    if isinstance(made, nn.Module):
        return made, None
    if hasattr(made, "model") and hasattr(made, "inputs"):
        made = (made.model, made.inputs)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        inputs = made[1]
        return made[0], inputs if isinstance(inputs, tuple) else (inputs,)
    raise ProfileError(
        f"factory {spec!r} returned {type(made).__name__}; it must return an nn.Module, "
        "(model, inputs) or an object with .model and .inputs"
    )
