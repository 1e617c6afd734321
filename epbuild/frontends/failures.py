"""What the command line says when a command fails: the exit code, the message for stderr
and, under ``--json``, the ``error`` object of the one JSON document on stdout.

Imported with ``cli`` on the no-op fast path: cheap standard library and ``errors`` only
(no ``dataclasses``, which costs more than the rest of the fast path's imports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from epbuild.errors import (
    BuildError,
    EpbuildError,
    Interrupted,
    LockTimeoutError,
    ManifestError,
    UsageError,
    UserError,
)

BUG_HINT = (
    "this is a bug in epbuild; run the command again with --debug (or EPBUILD_DEBUG=1) and "
    "report the traceback it shows"
)


class Failure:
    """One failed command as the CLI reports it (a plain class: a ``NamedTuple`` compiles its
    constructor when defined, on every command's startup)."""

    __slots__ = ("error", "exit_code", "text")

    def __init__(self, exit_code: int, text: str, error: dict[str, Any]) -> None:
        self.exit_code = exit_code
        self.text = text
        """What stderr gets (one message, then ``  hint: ...`` where there is one)."""
        self.error = error
        """The ``error`` object of the ``--json`` document."""


def _kind(exc: BaseException) -> str:
    """A stable word for the family of a failure (the ``error.kind`` of ``--json``)."""
    if isinstance(exc, UsageError):
        return "usage"
    if isinstance(exc, ManifestError):
        return "manifest"
    if isinstance(exc, UserError):
        return "user"
    if isinstance(exc, LockTimeoutError):
        return "lock_timeout"
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        return "interrupted"
    if isinstance(exc, BuildError | EpbuildError):
        return "build"
    if isinstance(exc, OSError):
        return "os"
    return "internal"


def _error(exc: BaseException, code: int, message: str, hint: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "class": type(exc).__name__,
        "kind": _kind(exc),
        "message": message,
        "hint": hint,
        "exit_code": code,
    }
    if isinstance(exc, ManifestError):
        doc.update(file=exc.file, line=exc.line, key=exc.key)
    elif isinstance(exc, OSError) and exc.filename is not None:
        doc["file"] = os.fsdecode(exc.filename)
    return doc


def describe(exc: BaseException, root: str) -> Failure:
    """The report of ``exc`` escaping a command run in ``root`` (``-C``)."""
    if isinstance(exc, UsageError):
        text = f"{exc.usage}{exc.prog}: error: {exc.message}"
        return Failure(2, text, _error(exc, 2, exc.message, None))
    if isinstance(exc, EpbuildError):
        return Failure(
            exc.exit_code,
            f"epbuild: error: {exc}",
            _error(exc, exc.exit_code, exc.message, exc.hint),
        )
    if isinstance(exc, FileNotFoundError) and working_directory_gone():
        gone = UserError(WORKING_DIRECTORY_GONE, hint=WORKING_DIRECTORY_HINT)
        return describe(gone, root)
    if isinstance(exc, OSError):  # a write no layer below expected to fail (a full disk)
        from epbuild.fs import os_error_hint, os_error_text

        reason, hint = os_error_hint(exc, root)
        message = reason or os_error_text(exc, root)
        return Failure(
            1, f"epbuild: error: {message}\n  hint: {hint}", _error(exc, 1, message, hint)
        )
    if isinstance(exc, KeyboardInterrupt):
        return Failure(130, "epbuild: interrupted", _error(exc, 130, "interrupted", None))
    message = f"{type(exc).__name__}: {exc}"[:2000]
    text = f"epbuild: internal error: {message}\n  hint: {BUG_HINT}"
    return Failure(1, text, _error(exc, 1, message, BUG_HINT))


WORKING_DIRECTORY_GONE = "the current directory no longer exists (it was deleted or moved)"
WORKING_DIRECTORY_HINT = "cd to a directory that exists, or give -C an absolute path"


def working_directory_gone() -> bool:
    """Whether the process's working directory was deleted under it (``os.getcwd`` fails:
    no relative path can be resolved)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def json_requested(argv: Sequence[str]) -> bool:
    """Whether ``--json`` (or an abbreviation argparse accepts, ``--js``) is on the command
    line, looked at before parsing so that a parse error can be a JSON document too."""
    for token in argv:
        if token == "--":
            return False
        if len(token) >= 4 and "--json".startswith(token):
            return True
    return False


GLOBAL_WITH_VALUE = ("-C", "-f", "--file")
"""The global options that take a value (skipped when finding the command's name)."""


def command_words(argv: Sequence[str], nested: Mapping[str, Sequence[str]]) -> str:
    """The command's name as ``--json`` documents say it (``build``, ``cache key``), from the
    raw arguments: used where parsing failed. ``nested`` maps a command to its
    sub-commands; an unknown command reads as ``epbuild``."""
    words: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in GLOBAL_WITH_VALUE:
            skip = True
            continue
        if token.startswith("-"):
            continue
        if not words:
            if token not in nested:
                return "epbuild"
            words.append(token)
            if not nested[token]:
                break
        else:
            if token in nested[words[0]]:
                words.append(token)
            break
    return " ".join(words) or "epbuild"
