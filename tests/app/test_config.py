"""The flags' one set of defaults (autopipe.app.config) and what each --help says about them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from autopipe.app.cli import build_parser
from autopipe.app.config import DEFAULT_BATCH, DEFAULT_CHUNKS, resolve


def _help(command: str, flag: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return str(sub.choices[command]._option_string_actions[flag].help)


def test_one_chunks_rule_stated_in_every_help() -> None:
    rule = "micro-batches per batch M (default: {}, else 4)"
    assert _help("partition", "--chunks") == rule.format("the profile's")
    assert _help("train", "--chunks") == rule.format("the --plan's, else the --profile's")
    assert _help("run", "--chunks") == rule.format("the --plan's")
    assert "(default 4; partition, train and run then default to the profile's or plan's)" in \
        _help("profile", "--chunks")
    assert _help("train", "--batch-size") == "mini-batch size B (default: the --plan's, else the --profile's, else 32)"
    assert _help("run", "--batch-size") == "mini-batch size B (default: the --plan's, else 32)"
    assert _help("profile", "--batch-size").startswith("mini-batch size B (default 32;")
    assert (DEFAULT_CHUNKS, DEFAULT_BATCH) == (4, 32)


@pytest.mark.parametrize(
    ("given", "made_for", "expected"),
    [(3, (8, 2), 3), (None, (8, 2), 8), (None, (None, 2), 2), (None, (None, None), 4), (None, (0, True), 4)],
)
def test_resolve_takes_the_flag_then_the_plan_then_the_profile(
    given: int | None, made_for: tuple[object, ...], expected: int
) -> None:
    assert resolve(given, *made_for, default=4) == expected


def test_profile_defaults_to_four_chunks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autopipe.app.cli import main

    assert main(["profile", "mlp", "--batch-size", "2", "--out", str(tmp_path / "p.csv")]) == 2
    assert capsys.readouterr().err == ("autopipe: error: chunks=4 > batch size 2: micro-batches would be "
                                       "empty; use chunks <= 2\n")
