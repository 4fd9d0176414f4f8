"""User errors: the one home of `check`, `InputError`, `first_line`, `user_error` and `cli_error`.

A user mistake (bad config, malformed corpus, missing file) is a one-line `ValueError` that
names the problem and the fix; the CLIs print it without a traceback (`cli_error`). Nothing here imports
anything of raymt, so every module may use it.
"""

from __future__ import annotations

import re
import sys
from typing import Optional


class InputError(ValueError):
    """A user mistake found while reading inputs, possibly inside a Ray task."""


def check(ok: bool, message: str) -> None:
    """Raise a one-line ValueError for a user mistake when `ok` is false."""
    if not ok:
        raise ValueError(message)


def first_line(err: BaseException) -> str:
    """The first line of an exception message (library messages can span many lines)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def user_error(err: BaseException) -> Optional[ValueError]:
    """The one-line InputError inside an exception that a Ray task raised, if there is one.

    Ray Data re-raises a UDF's error as RayTaskError(UserCodeException) whose chain holds
    only the remote traceback as text, so the message is found in that text.
    """
    stack, seen = [err], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, InputError):
            return ValueError(str(e))
        match = re.search(rf"{re.escape(InputError.__module__)}\.InputError: (.+)", str(e))
        if match:
            return ValueError(match.group(1).strip())
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


def cli_error(prog: str, message: object, status: int = 2) -> int:
    """Print a command's one-line error, `PROG: error: MESSAGE`, on stderr; returns the exit status."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status
