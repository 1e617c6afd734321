"""The ``epbuild`` command line's entry point: parse (``parser``), run the command
(``commands``), report a failure (``failures``) and return the exit code.

Exit codes: 0 success, 1 build failure, 2 user error, 3 lock timeout, 130 interrupted.
Kept cheap to import: ``epbuild build`` with nothing to do answers from the no-op fast path
before the API (or anything heavier) is loaded.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's module less its enums
import argparse
import gc
import os
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager

from epbuild.errors import UserError
from epbuild.frontends import failures, render
from epbuild.frontends.commands import COMMANDS, RARE_COLLECTIONS, usual_collections
from epbuild.frontends.parser import build_parser

__all__ = ["COMMANDS", "build_parser", "console", "main"]

_parser = build_parser
"""The parser (``epbuild.frontends.parser.build_parser``), under the name the reference
generator and older callers use."""


def console() -> int:
    """The ``epbuild`` program (its console script and ``python -m epbuild``): ``main()`` on
    the process's arguments, the cyclic collector started every ``RARE_COLLECTIONS``
    allocations instead of every 700 (``watch`` aside); returns the exit code. Then
    ``gc.freeze()``: the interpreter's exit skips its last collection over everything the
    command imported and loaded (a tenth of restoring one action); atexit handlers and
    thread joins still run."""
    gc.set_threshold(RARE_COLLECTIONS, *gc.get_threshold()[1:])
    code = main()
    gc.freeze()
    return code


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (``console`` runs it as the program).

    A failure is one message on stderr (its traceback too with ``--debug``); under
    ``--json`` stdout also carries one JSON document with ``ok: false`` and ``error``, unless
    the command printed its own."""
    from epbuild import _stacks

    _stacks.register()
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = failures.json_requested(argv)
    debug = "--debug" in argv or os.environ.get("EPBUILD_DEBUG", "") not in ("", "0")
    command, directory, printed = "epbuild", ".", render.documents_printed()
    render.command_notes([])
    _signal.signal(_signal.SIGTERM, _sigterm)
    if as_json and "--version" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        from epbuild._version import __version__

        render.print_json({"version": __version__}, command="version")
        return 0
    try:
        args = build_parser(raise_usage_errors=True, argv=argv).parse_args(argv)
        command, directory = _command_name(args), args.directory
        debug = debug or args.debug
        notes = list(getattr(args, "deprecated", None) or [])
        render.command_notes(notes)
        if directory != "." and not os.path.isdir(directory):
            raise UserError(f"-C {directory}: no such directory")
        with _waiting(args), usual_collections(args.command):
            code = COMMANDS[args.command](args)
        if code == 0 and not as_json:  # a refusal stays one message; --json: in warnings
            for note in notes:
                print(f"epbuild: warning: {note}", file=sys.stderr)
        return code
    except (Exception, KeyboardInterrupt) as exc:
        if command == "epbuild":
            command = failures.command_words(argv, _NESTED)
        if debug and not isinstance(exc, KeyboardInterrupt):
            import traceback

            traceback.print_exc()
        failure = failures.describe(exc, os.path.abspath(directory))
        print(failure.text, file=sys.stderr)
        quiet_stop = command == "watch" and isinstance(exc, KeyboardInterrupt)
        if as_json and not quiet_stop and render.documents_printed() == printed:
            render.print_error_json(command, failure.error)
        return failure.exit_code


_NESTED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("build", "status", "init", "add", "clean", "verify", "package"), ()),
    **dict.fromkeys(("report", "watch", "toolchains", "lock", "schema"), ()),
    "cache": ("key", "export", "import", "prune", "verify"),
}
"""Each command and its sub-commands, for naming a command whose arguments did not parse."""


def _waiting(args: argparse.Namespace) -> AbstractContextManager[None]:
    """The command's ``--lock-timeout`` for every lock it takes, and its waiting message on
    stderr (``state.waiting``)."""
    from epbuild.frontends import args as checks
    from epbuild.state import waiting

    timeout = checks.seconds(getattr(args, "lock_timeout", None), "--lock-timeout")
    return waiting.bounded(timeout, lambda msg: print(f"epbuild: {msg}", file=sys.stderr))


def _command_name(args: argparse.Namespace) -> str:
    """``build``, ``cache key``, ``add model``: the ``command`` of the JSON documents."""
    sub = getattr(args, "cache_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


if __name__ == "__main__":
    sys.exit(console())
