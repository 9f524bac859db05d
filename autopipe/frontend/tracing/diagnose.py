"""What a failed trace tells the user: torch's own noise kept out, the user's line kept in.

[Note: a quiet tracer] torch.export and fake tensors report through the ``torch`` logger tree
(``W... symbolic_shapes.py] Unable to find user code corresponding to {u0}`` and dozens like
it per failed attempt), print partial graphs, and warn about their own internals; none of it is
the user's business, since every failure ends in one TraceError line. :func:`quiet` raises the
level of every ``torch`` logger (loggers created inside inherit it), captures stdout and stderr
and ignores warnings, for the tracer's calls only: on exit every level is set back, so the
user's logging afterwards is exactly what it was. Levels are assigned, and logging's per-logger
caches cleared once after each change: ``setLevel`` clears every logger's cache on every call,
so one ``setLevel`` per logger, over the hundreds that torch and a HuggingFace model make, is
quadratic in their number and was most of what quieting a trace cost (CHANGELOG.md, "`quiet()`
(the tracer's silenced torch loggers)").

[Note: the user's line] A one-line error cannot carry a traceback, so it names the line of the
model's code where tracing broke: the innermost frame of the exception that belongs neither to
torch, nor to autopipe, nor to Python itself (a HuggingFace model's line counts: it is the
model's code), or, for a graph node that failed later, the same frame of the node's recorded
stack trace.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sysconfig
import traceback
import warnings
from collections.abc import Iterator

import torch

__all__ = ["quiet", "user_line", "user_line_in"]

_QUIET = logging.CRITICAL + 1
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # autopipe/
_NOT_USER = tuple(
    os.path.realpath(p) + os.sep
    for p in (
        os.path.dirname(torch.__file__),
        _PACKAGE,
        os.path.join(os.path.dirname(_PACKAGE), "executor"),
        sysconfig.get_paths()["stdlib"],
    )
)


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Silence torch's logs, prints and warnings for the tracer (see [Note: a quiet tracer])."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in list(manager.loggerDict.items())
        if isinstance(lg, logging.Logger) and name.startswith("torch.")
    ]
    levels = [(lg, lg.level) for lg in loggers]
    sink = io.StringIO()
    try:
        _set_levels([(lg, _QUIET) for lg in loggers])
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
                contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield sink
    finally:
        _set_levels(levels)


def _set_levels(levels: list[tuple[logging.Logger, int]]) -> None:
    """``lg.setLevel(level)`` for each pair, clearing logging's caches once, not per logger."""
    for lg, level in levels:
        lg.level = level
    logging.getLogger("torch").setLevel(logging.getLogger("torch").level)  # clears every cache


def _is_user(filename: str) -> bool:
    if filename.startswith("<"):  # generated code (fx's forward, exec'd strings)
        return False
    return not os.path.realpath(filename).startswith(_NOT_USER)


def _where(filename: str, line: int) -> str:
    path = os.path.realpath(filename)
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{line}"


def user_line(err: BaseException) -> str:
    """``path:line`` of the innermost user frame in ``err``'s traceback, or "" (see
    [Note: the user's line])."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:  # a chained cause may hold it
        seen.add(id(current))
        for frame in reversed(traceback.extract_tb(current.__traceback__)):
            if _is_user(frame.filename) and frame.lineno is not None:
                return _where(frame.filename, frame.lineno)
        current = current.__cause__ or current.__context__
    return ""


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def user_line_in(stack_trace: str | None) -> str:
    """``path:line`` of the innermost user frame in a recorded stack trace (fx node meta)."""
    frames = _FRAME.findall(stack_trace or "")
    for filename, line in reversed(frames):
        if _is_user(filename):
            return _where(filename, int(line))
    return ""
