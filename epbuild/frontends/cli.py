"""The ``epbuild`` command line's entry point: parse (``parser``), run the command
(``commands``), report a failure (``failures``) and return the exit code.

Exit codes: 0 success, 1 build failure, 2 user error, 3 lock timeout, 130 interrupted.
Kept cheap to import: ``epbuild build`` with nothing to do answers from the no-op fast path
before the API (or anything heavier) is loaded.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's module less its enums
import argparse
import errno
import gc
import io
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from epbuild.errors import StorageError, UserError
from epbuild.frontends import failures, render
from epbuild.frontends.commands import COMMANDS, RARE_COLLECTIONS, usual_collections
from epbuild.frontends.parser import build_parser

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

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
    _standard_streams()
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and --version: their output is flushed below
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    try:
        sys.stdout.flush()  # here, not at exit: a failure is then one message and its code
    except (OSError, StorageError) as exc:
        code = code or 1
        print(failures.describe(exc, ".").text, file=sys.stderr)
    for signum in _STOPPING:  # the command has ended: a second Ctrl-C ends its exit too
        if _stops(signum):
            _signal.signal(signum, _stopped(code))
    gc.freeze()
    return code


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stopped(code: int) -> Callable[[int, object], None]:
    """A signal handler that ends the process at once with ``code``: what Ctrl-C does once
    the command has ended and said so (instead of a traceback out of the interpreter's exit)."""

    def handler(signum: int, frame: object) -> None:
        os._exit(code)

    return handler


def _stops(signum: int) -> bool:
    """Whether the signal ``signum`` interrupts the command like Ctrl-C: SIGTERM, and SIGHUP
    (a closed terminal or SSH session) unless it is ignored (``nohup``)."""
    return bool(signum == _signal.SIGTERM or _signal.getsignal(signum) != _signal.SIG_IGN)


_HANGUP = [_signal.SIGHUP] if hasattr(_signal, "SIGHUP") else []  # none on Windows
_STOPPING = (_signal.SIGINT, _signal.SIGTERM, *_HANGUP)
"""The signals that interrupt a command (``_stops``; SIGINT as Python's own Ctrl-C; Windows
has no SIGHUP)."""


class _Output(io.RawIOBase):
    """Standard output or error as the command line writes them (``_standard_streams``).

    A reader that went away (``epbuild status | head -1``: a broken pipe) takes the rest
    of the output, and the command goes on to its own exit code. On stderr every other
    failure (a full disk) goes the same way: progress and messages never fail a command.
    On stdout, where the output is the command's answer, it is one ``StorageError`` (exit
    code 1), the rest of the output then dropped. Dropped: ``/dev/null`` put on the
    descriptor, for the buffer's last flush at exit and for child processes alike."""

    def __init__(self, fd: int, name: str) -> None:
        super().__init__()
        self.fd = fd
        self.name = name
        self.reader_gone = False
        """Whether the pipe's reader went away (``render.stdout_reader_gone``)."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data: ReadableBuffer) -> int:
        while True:
            try:
                return os.write(self.fd, data)
            except BlockingIOError:  # a descriptor another program made non-blocking
                import select

                select.select([], [self.fd], [])
            except OSError as exc:
                _drop(self.fd)
                self.reader_gone = exc.errno == errno.EPIPE
                if self.fd == 1 and exc.errno != errno.EPIPE:
                    reason = exc.strerror or type(exc).__name__
                    raise StorageError(
                        f"cannot write to standard output: {reason}",
                        hint="check where stdout goes (a full disk, a file-size limit)",
                    ) from None
                return memoryview(data).nbytes


def _drop(fd: int) -> None:
    """``/dev/null`` on ``fd``: what is written to it from now on goes nowhere."""
    null = os.open(os.devnull, os.O_RDWR)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _standard_streams() -> None:
    """A closed descriptor 0, 1 or 2 (``epbuild status >&-``) gets ``/dev/null``, so that
    no file the command opens takes its number (a child's output would land in it); then
    ``sys.stdout`` and ``sys.stderr`` are ``_Output`` streams in the encoding Python chose,
    writing what that encoding cannot spell as escapes (``\\xf6``) rather than failing.
    POSIX only: Windows keeps Python's own streams (a console's is written as UTF-16 by
    ``WriteConsoleW``, which bytes written to the descriptor would not be)."""
    if os.name != "posix":
        return
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _drop(fd)
    for fd, name, old in ((1, "<stdout>", sys.stdout), (2, "<stderr>", sys.stderr)):
        encoding = getattr(old, "encoding", None) or "utf-8"
        line_buffering = bool(getattr(old, "line_buffering", False))
        # Unbuffered where Python's own is (stderr; stdout too under PYTHONUNBUFFERED or -u):
        # a line is out when written.
        unbuffered = fd == 2 or bool(getattr(old, "write_through", False))
        raw = _Output(fd, name)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=encoding,
            errors="backslashreplace",
            line_buffering=line_buffering,
            write_through=unbuffered,
        )
        if fd == 1:
            sys.stdout = stream
        else:
            sys.stderr = stream


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
    for signum in _STOPPING[1:]:
        if _stops(signum):
            _signal.signal(signum, _sigterm)
    try:
        if as_json and "--version" in argv[: argv.index("--") if "--" in argv else len(argv)]:
            from epbuild._version import __version__

            render.print_json({"version": __version__}, command="version")
            return 0
        args = build_parser(raise_usage_errors=True, argv=argv).parse_args(argv)
        command, directory = _command_name(args), args.directory
        debug = debug or args.debug
        notes = list(getattr(args, "deprecated", None) or [])
        render.command_notes(notes)
        if not os.path.isabs(directory) and failures.working_directory_gone():
            hint = failures.WORKING_DIRECTORY_HINT
            raise UserError(failures.WORKING_DIRECTORY_GONE, hint=hint)
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
        failure = failures.describe(exc, _absolute(directory))
        print(failure.text, file=sys.stderr)
        quiet_stop = command == "watch" and isinstance(exc, KeyboardInterrupt)
        if as_json and not quiet_stop and render.documents_printed() == printed:
            try:
                render.print_error_json(command, failure.error)
            except (OSError, StorageError) as lost:  # an unbuffered stdout fails here, not at exit
                print(failures.describe(lost, ".").text, file=sys.stderr)
        return failure.exit_code


def _absolute(directory: str) -> str:
    """``directory`` as an absolute path; as given where the working directory is gone."""
    try:
        return os.path.abspath(directory)
    except OSError:
        return directory


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
