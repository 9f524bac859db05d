"""The ``autopipe`` command line: argv -> config -> one library call. No logic lives here.

    autopipe profile MODEL ...       measure a model's layers            (autopipe.profiler)
    autopipe partition PROFILE ...   balance the layers into stages      (autopipe.partition)
    autopipe simulate PLAN ...       predict the pipeline's timeline     (autopipe.simulate)
    autopipe plot PLAN ...           draw balance / timeline figures     (autopipe.plot)
    autopipe run MODEL --plan ...    train a bundled example with torchrun (executor.distributed)

Every AutopipeError (a ValueError subclass with a one-line message saying what to do) is printed
as ``autopipe: error: ...`` and the exit status is 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from autopipe.errors import AutopipeError

__all__ = ["main", "build_parser"]

# Each subcommand module-level function registers its parser and returns nothing; the handler
# is stored as the ``func`` default on the subparser and receives the parsed namespace.
Handler = Callable[[argparse.Namespace], int]
_REGISTRARS: list[Callable[[argparse._SubParsersAction], None]] = []  # type: ignore[type-arg]


def _register(fn: Callable[[argparse._SubParsersAction], None]) -> Callable[[argparse._SubParsersAction], None]:  # type: ignore[type-arg]
    _REGISTRARS.append(fn)
    return fn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopipe", description="GPipe done automatically: profile, partition, run."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for registrar in _REGISTRARS:
        registrar(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except AutopipeError as err:
        print(f"autopipe: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"autopipe: error: {err.filename or err}: no such file", file=sys.stderr)
        return 2


# --- subcommands -------------------------------------------------------------------------------
# Add each subcommand below as a ``@_register``-decorated function that adds a subparser with
# ``set_defaults(func=handler)``; the handler parses nothing itself and calls one library function.


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
