"""Each ``epbuild`` command as a function of its parsed arguments that returns the exit
code (:data:`COMMANDS`): the library called thinly, its result rendered (``render``).

A command's module is imported when the command runs, so that a command loads only what it
uses (``build``'s no-op fast path most of all): ``build_cli`` (build), ``watch_cli``,
``workspace_cli`` (status, clean), ``verify_cli`` (verify, report), ``package_cli``,
``edit_cli`` (init, add, schema), ``cache_cli``, ``lock_cli`` and ``toolchain_cli``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
from collections.abc import Callable, Iterator

RARE_COLLECTIONS = 50_000
"""The cyclic collector's first-generation threshold in the program (``cli.console``; Python's
is 700): a command imports the library and builds a mostly acyclic picture of the workspace,
which each collection on the way re-scanned (27 of them restoring one action, a twentieth of
its time); a build that runs for hours still collects what it leaves in cycles."""

_USUAL = gc.get_threshold()
"""The thresholds as they were when the command line was imported."""


@contextlib.contextmanager
def usual_collections(command: str) -> Iterator[None]:
    """``watch`` runs for hours, and with the usual collection thresholds, whatever the
    program set (``RARE_COLLECTIONS``)."""
    before = gc.get_threshold()
    if command == "watch":
        gc.set_threshold(*_USUAL)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _command(target: str) -> Callable[[argparse.Namespace], int]:
    """The command ``module:function`` (in ``epbuild.frontends``), imported when it runs."""
    module, _, name = target.partition(":")

    def run(args: argparse.Namespace) -> int:
        function: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(f"epbuild.frontends.{module}"), name
        )
        return function(args)

    run.__name__ = run.__qualname__ = name
    return run


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "build": _command("build_cli:run_build"),
    "status": _command("workspace_cli:run_status"),
    "init": _command("edit_cli:run_init"),
    "add": _command("edit_cli:run_add"),
    "clean": _command("workspace_cli:run_clean"),
    "verify": _command("verify_cli:run_verify"),
    "package": _command("package_cli:run_package"),
    "report": _command("verify_cli:run_report"),
    "watch": _command("watch_cli:run_watch"),
    "cache": _command("cache_cli:run_cache_command"),
    "toolchains": _command("toolchain_cli:run_toolchains_command"),
    "lock": _command("lock_cli:run_lock_command"),
    "schema": _command("edit_cli:run_schema"),
}
"""Command name → its function (``main`` looks the parsed command up here)."""
