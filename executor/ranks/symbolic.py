"""Fake runs at symbolic input sizes: the shapes of a computation as formulas of its inputs'.

[Note: symbolic sizes] A fake run (FakeTensorMode: shapes, no data) whose inputs have a symbol
per dimension instead of a number records in a ShapeEnv every constraint the computation puts
on those sizes, and gives every value it makes a shape over those symbols. The shape at other
input sizes is then that formula evaluated there, without running anything: executor/ranks/wire.py
sizes the receive buffers of a distributed pipeline this way. An input dimension the
computation fixes (a view to a constant size, a Linear's ``in_features``) is a symbol the
ShapeEnv replaced by a number, so its formulas are numbers too.

Formulas are written over symbols named ``in{i}_{d}`` (input ``i``, dimension ``d``) so that a
formula means the same thing in every process. Sizes 0 and 1 stay numbers (torch specializes
them: a formula in them would be a guess), and duck sizing is off: two dimensions that happen to
be equal in the example are two symbols.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from executor._torch_compat import FakeTensorMode, symbol_source

__all__ = ["SymbolicRun", "symbolic_run", "evaluate", "input_symbol"]


def input_symbol(i: int, d: int) -> sympy.Symbol:
    """The symbol formulas use for dimension ``d`` of input ``i``."""
    return sympy.Symbol(f"in{i}_{d}", integer=True, positive=True)


@dataclass
class SymbolicRun:
    """One fake run of ``fn`` at symbolic input sizes (see [Note: symbolic sizes])."""

    outputs: Any  # what fn returned: fake tensors with symbolic sizes, SymInts, constants
    env: ShapeEnv
    symbols: dict[sympy.Symbol, sympy.Symbol]  # the ShapeEnv's symbol -> input_symbol(i, d)

    def formula(self, value: int | torch.SymInt) -> int | sympy.Expr:
        """A size of this run as a number or a formula over :func:`input_symbol` symbols."""
        if isinstance(value, int):
            return value
        expr = self.env.replace(value.node.expr).xreplace(self.symbols)
        return int(expr) if expr.is_number else expr


def evaluate(formula: int | sympy.Expr, sizes: Sequence[Sequence[int] | None]) -> int:
    """A formula of a :class:`SymbolicRun` at concrete input sizes (``sizes[i][d]``)."""
    if isinstance(formula, int):
        return formula
    values: Mapping[sympy.Basic, sympy.Integer] = {
        input_symbol(i, d): sympy.Integer(n)
        for i, shape in enumerate(sizes) if shape is not None for d, n in enumerate(shape)
    }
    result = formula.xreplace(values)
    if not result.is_number:
        raise ValueError(f"size {formula} depends on values other than the input sizes")
    return int(result)


def symbolic_run(fn: Callable[..., Any], inputs: Sequence[Any]) -> SymbolicRun:
    """Run ``fn(*inputs)`` on fake copies of the tensor inputs whose sizes >= 2 are symbols.

    Raises whatever the fake run raises (an op without a fake kernel, a data-dependent size):
    callers treat that as "no formulas" and keep the example's sizes.
    """
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    # Its dispatch cache off: each op of one run of symbolic sizes is a miss whose entry costs more
    # than the op (infer_wires 25-35% faster on GPT-2; the fake runs of the tracer, at concrete sizes
    # and repeated, keep it)
    mode.cache_enabled = False
    symbols: dict[sympy.Symbol, sympy.Symbol] = {}
    fakes: list[Any] = []
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            fakes.append(x)
            continue
        dynamic = [DimDynamic.DYNAMIC if n >= 2 else DimDynamic.STATIC for n in x.shape]
        context: Any = StatelessSymbolicContext(dynamic_sizes=dynamic,
                                                constraint_sizes=[None] * x.dim())  # type: ignore[arg-type]
        fake = mode.from_tensor(x, symbolic_context=context, source=symbol_source(f"input{i}"))
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt):
                symbols[size.node.expr] = input_symbol(i, d)
        fakes.append(fake)
    with mode:
        outputs = fn(*fakes)
    return SymbolicRun(outputs, env, symbols)
