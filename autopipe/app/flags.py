"""argparse from the config dataclasses (autopipe.app.config): one flag per field.

    parser = argparse.ArgumentParser(prog="autopipe run")
    add_arguments(parser, RunConfig)
    config = from_namespace(RunConfig, parser.parse_args(argv))

A field's metadata (``_opt`` / ``_pos`` in config.py) carries its help, and the dataclass its
type and default, so a flag cannot drift from the library call it feeds ([Note: one place for
defaults] in autopipe/app/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, Literal

__all__ = ["add_arguments", "from_namespace"]


def _unwrap(kind: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); X -> (X, False)."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return rest[0], len(rest) < len(args)
    return kind, False


def add_arguments(parser: argparse.ArgumentParser, config: type) -> None:
    """Add one argument per field of the dataclass ``config`` (see [Note: one place for defaults])."""
    hints = typing.get_type_hints(config)
    # a base's keyword-only fields (where the ranks run: config.Launch) after the command's own
    for f in sorted(dataclasses.fields(config), key=lambda f: f.kw_only is True):
        meta = dict(f.metadata)
        kind, _ = _unwrap(hints[f.name])
        help_text = meta.pop("help")
        if meta.pop("positional", False):
            parser.add_argument(f.name, help=help_text, **meta)
            continue
        flag = "--" + f.name.replace("_", "-")
        switches = meta.pop("switches", None)
        if switches is not None:  # a choice made by mutually exclusive switches, e.g. --timeline
            group = parser.add_mutually_exclusive_group()
            for switch, (value, text) in switches.items():
                group.add_argument(switch, action="store_const", const=value, dest=f.name, help=text)
            parser.set_defaults(**{f.name: f.default})
            continue
        renamed_from = meta.pop("renamed_from", None)
        kw: dict[str, Any] = {"help": help_text, "dest": f.name, **meta}
        if f.default is not dataclasses.MISSING and not meta.get("required"):
            kw["default"] = f.default
        if kind is bool:
            kw["action"] = "store_true"
        elif typing.get_origin(kind) is Literal:
            # shown, not enforced by argparse: its refusal is a usage dump; the library's own
            # check answers in one line with exit status 2 (cli.main)
            kw["metavar"] = "|".join(typing.get_args(kind))
        elif typing.get_origin(kind) is list:
            kw.setdefault("metavar", f.name.upper())
        else:
            kw["type"] = kind
        parser.add_argument(flag, **kw)
        if renamed_from is not None:  # the flag's old name, hidden, for one more release
            parser.add_argument(renamed_from, **{**kw, "help": argparse.SUPPRESS,
                                                 "action": _renamed(renamed_from, flag)})


def _renamed(old: str, new: str) -> type[argparse.Action]:
    """An argparse action that stores the value and says, in one line on stderr, the new name."""

    class Renamed(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: Any, option_string: str | None = None) -> None:
            print(f"autopipe: {old} is now {new}; {old} will be removed in the next release",
                  file=sys.stderr)
            setattr(namespace, self.dest, values)

    return Renamed


def from_namespace(config: type, args: argparse.Namespace) -> Any:
    """The config dataclass filled from parsed arguments."""
    return config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config)})
