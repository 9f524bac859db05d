"""Resolve a MODEL argument of the command line into a model and one batch of inputs.

    load_model("mlp", batch_size=32)                          # a bundled example
    load_model("mypkg.models:make", batch_size=32)            # factory -> (model, inputs)
    load_model("mypkg.models:Net", 32, input_shape=(3, 32, 32))  # factory -> model; random inputs

A factory is any callable ``package.module:name``; its module is imported like ``python -m``
would, so a ``myfactory.py`` in the current directory needs no PYTHONPATH. It is called with
``batch_size=B`` when it has a ``batch_size`` parameter, else with no arguments (seeded, so
every rank of ``autopipe run`` builds the same inputs), and returns ``(model, inputs)``,
``(model, inputs, target, loss_fn)``, ``(model, batch)`` with ``batch`` a dict of keyword inputs
(an HF batch: ``input_ids=``, ``attention_mask=``, ``labels=``; profiled as
``autopipe.profile(model, example_kwargs=batch)``, not trained from the command line), an object with ``.model`` and ``.inputs`` (and
``.target`` and ``.loss_fn``, like :class:`autopipe.examples.Example`), or a bare ``nn.Module``,
in which case ``input_shape`` (one sample's shape, without the batch dimension) makes a random
float batch. Training (``autopipe train``, ``autopipe run``) needs the target and the loss.

Training draws each step's batch with :meth:`LoadedModel.batch` ([Note: a batch per step] in
autopipe/examples.py): a bundled example's ``Example.batch(step)``, or a factory's object's own
``batch(step) -> (inputs, target)`` method; a factory that returns a tuple, or an object without
``batch``, trains on its one batch at every step.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopipe.errors import ProfileError, first_line
from executor._torch_compat import tree_map_only

__all__ = ["LoadedModel", "load_model"]


@dataclass
class LoadedModel:
    name: str  # short name: the example name or the factory's name
    model: nn.Module
    inputs: tuple[Any, ...]
    target: Any = None  # what loss_fn compares the output with (None: the factory gave none)
    loss_fn: Callable[[Any, Any], Any] | None = None
    batches: Callable[[int], tuple[Any, Any]] | None = None  # step -> (inputs, target)
    kwargs: dict[str, Any] | None = None  # a keyword batch (an HF one), for profile()'s example_kwargs

    def batch(self, step: int) -> tuple[tuple[Any, ...], Any]:
        """Step ``step``'s (0-based) inputs and target: step 0's are ``inputs`` / ``target``; later
        ones from ``batches`` when the model brings them, else the same one batch."""
        if step == 0 or self.batches is None:
            return self.inputs, self.target
        inputs, target = self.batches(step)
        return (inputs if isinstance(inputs, tuple) else (inputs,)), target


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
    module = _import(module_name, spec)
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


def _import(module_name: str, spec: str) -> Any:
    """Import the factory's module with the current directory on sys.path, as ``python -m``
    has it; one line saying why when that fails."""
    here = os.getcwd()
    if not any(os.path.abspath(p or ".") == here for p in sys.path):
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if isinstance(err, ModuleNotFoundError) and missing and module_name.startswith(missing):
            raise ProfileError(
                f"cannot import module {module_name!r} of model {spec!r} ({first_line(err)}); check "
                f"the name: {module_name.replace('.', '/')}.py must be in the current directory "
                f"({here}) or on PYTHONPATH"
            ) from None
        raise ProfileError(
            f"importing module {module_name!r} of model {spec!r} failed ({first_line(err)}); "
            f"fix that import in {module_name!r} (is the package it needs installed?)"
        ) from None
    except Exception as err:  # the user's module: a SyntaxError, an error at import time
        raise ProfileError(
            f"importing module {module_name!r} of model {spec!r} raised {first_line(err)}; fix the module"
        ) from None


def _random_batch(batch_size: int, input_shape: Sequence[int]) -> tuple[torch.Tensor]:
    if any(d < 1 for d in input_shape):
        raise ProfileError(f"input shape {list(input_shape)} has a non-positive dimension; use sizes >= 1")
    return (torch.randn(batch_size, *input_shape),)


def _building(meta: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.device("meta") if meta else contextlib.nullcontext()


def _real_inputs(loaded: LoadedModel) -> LoadedModel:
    """Meta inputs and targets remade real ([Note: models built on meta])."""

    def real(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return out.normal_() if out.is_floating_point() else out.zero_()

    loaded.inputs = tree_map_only(torch.Tensor, real, loaded.inputs)
    loaded.kwargs = tree_map_only(torch.Tensor, real, loaded.kwargs)
    loaded.target = tree_map_only(torch.Tensor, real, loaded.target)
    return loaded


def load_model(
    spec: str,
    batch_size: int | None = None,
    *,
    input_shape: Sequence[int] | None = None,
    for_training: str | None = None,
    meta: bool = False,
) -> LoadedModel:
    """Build the model named by ``spec`` with a batch of ``batch_size`` rows (default 32).

    [Note: models built on meta] With ``meta``, the example or factory runs under
    ``torch.device("meta")``, so the model's tensors take no memory (profile it layer by
    layer). Inputs it made there have no values: they are remade real, integer ones as zeros
    (a valid token id) and floating ones as random values, with their shapes and dtypes.

    ``for_training``: the command that trains it (e.g. ``"autopipe train"``); a factory must then
    also return a target and a loss function.
    """
    from autopipe.examples import EXAMPLES, get_example

    if batch_size is not None and batch_size < 1:
        raise ProfileError(f"batch size must be >= 1, got {batch_size}; pass --batch-size 1 or more")
    if spec in EXAMPLES:
        if input_shape is not None:
            raise ProfileError(f"--input-shape is for a factory returning a bare model; the bundled "
                               f"example {spec!r} brings its own inputs: drop --input-shape")
        with _building(meta):
            ex = get_example(spec, batch_size or 32)
        return _real_inputs(LoadedModel(spec, ex.model, ex.inputs, ex.target, ex.loss_fn, ex.batch))
    factory = _factory(spec)
    try:
        takes_batch = "batch_size" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        takes_batch = False
    try:
        with torch.random.fork_rng(), _building(meta):
            torch.manual_seed(0)  # every rank of `autopipe run` builds the same inputs and targets
            made = factory(batch_size=batch_size or 32) if takes_batch else factory()
    except Exception as err:  # the user's code: report it in one line
        raise ProfileError(f"factory {spec!r} raised {first_line(err)}; fix the factory") from None
    name = spec.partition(":")[2].split(".")[-1]
    loaded = _real_inputs(_unpack(spec, name, made))
    if for_training and loaded.kwargs is not None:
        raise ProfileError(
            f"factory {spec!r} returned a keyword batch, which {for_training} does not take (it "
            "trains on positional inputs, a target and a loss_fn); train it in Python: "
            "pipe = autopipe.pipeline(model, example_kwargs=batch, plan=autopipe.Plan.load(...))")
    if for_training and (not loaded.inputs or loaded.loss_fn is None or loaded.target is None):
        raise ProfileError(
            f"factory {spec!r} returned no inputs, target and loss function, which {for_training} "
            "needs; return (model, inputs, target, loss_fn) or an object with .model, .inputs, "
            ".target and .loss_fn (like autopipe.examples.Example)"
        )
    given = loaded.inputs or tuple((loaded.kwargs or {}).values())  # positional or keyword
    if not given:
        if input_shape is None:
            raise ProfileError(
                f"factory {spec!r} returned a model without inputs; pass --input-shape (one "
                "sample's shape, e.g. 3,32,32) or return (model, inputs)"
            )
        loaded.inputs = _random_batch(batch_size or 32, input_shape)
    elif input_shape is not None:
        raise ProfileError(
            f"factory {spec!r} returns its own inputs, so --input-shape {','.join(map(str, input_shape))} "
            "would be ignored; drop --input-shape (it is for factories returning a bare model)"
        )
    elif batch_size is not None and not takes_batch:
        got = next((int(t.shape[0]) for t in given if isinstance(t, torch.Tensor) and t.dim()), None)
        if got is not None and got != batch_size:
            raise ProfileError(
                f"factory {spec!r} returned inputs of batch {got} but --batch-size is {batch_size}; "
                "give the factory a batch_size parameter or drop --batch-size"
            )
    return loaded


def _unpack(spec: str, name: str, made: Any) -> LoadedModel:
    if isinstance(made, nn.Module):
        return LoadedModel(name, made, ())
    batches = getattr(made, "batch", None) if hasattr(made, "model") and hasattr(made, "inputs") else None
    if hasattr(made, "model") and hasattr(made, "inputs"):
        made = (made.model, made.inputs, getattr(made, "target", None), getattr(made, "loss_fn", None))
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and isinstance(made[1], dict):
        if not all(isinstance(k, str) for k in made[1]):
            raise ProfileError(f"factory {spec!r} returned a batch dict with non-string keys; key it by "
                               "the forward's parameter names (input_ids=..., attention_mask=...)")
        return LoadedModel(name, made[0], (), kwargs=dict(made[1]))
    if isinstance(made, tuple) and len(made) in (2, 4) and isinstance(made[0], nn.Module):
        inputs = made[1] if isinstance(made[1], tuple) else (made[1],)
        target, loss_fn = made[2:] if len(made) == 4 else (None, None)
        if loss_fn is not None and not callable(loss_fn):
            raise ProfileError(f"factory {spec!r} returned a loss_fn of type {type(loss_fn).__name__}; "
                               "it must be callable as loss_fn(output, target)")
        return LoadedModel(name, made[0], inputs, target, loss_fn, batches if callable(batches) else None)
    raise ProfileError(
        f"factory {spec!r} returned {type(made).__name__}; it must return an nn.Module, "
        "(model, inputs), (model, inputs, target, loss_fn) or an object with .model and .inputs"
    )
