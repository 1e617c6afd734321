"""Each ``epbuild`` command as a function of its parsed arguments that returns the exit
code (:data:`COMMANDS`): the library called thinly, its result rendered (``render``).

``build``/``watch`` live in ``build_cli``, ``init``/``add`` in ``edit_cli``, ``cache``,
``lock`` and ``toolchains`` in their own modules. Imported on the no-op fast path:
everything beyond the standard library loads inside the command that needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator

from epbuild._names import GENERATE_TIMEOUT
from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.build_cli import run_build, run_watch
from epbuild.frontends.edit_cli import run_add, run_init
from epbuild.frontends.render import print_json, status_lines


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Run without the cyclic garbage collector: status imports the library and builds a
    large, acyclic picture of the workspace (the journal's records, a key per action) once,
    then exits; every full collection on the way re-scanned all of it (a tenth of ``status``
    at 5,000 actions). Reference counting still frees what is dropped."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


@_collector_paused()
def _status(args: argparse.Namespace) -> int:
    if args.graph and (args.detail or args.json):
        raise UserError(
            f"status --graph prints a {args.graph} graph: it takes neither --detail nor --json",
            hint="'status --json' has each action's kind and deps",
        )
    if args.detail and (args.cache or args.no_cache):
        raise UserError(
            "status --detail reads the built outputs, not the cache: --cache and --no-cache "
            "do not apply",
            hint="drop the cache option, or leave out --detail",
        )
    if args.detail:
        from epbuild.inspection.detail import render as detail_lines
        from epbuild.inspection.detail import status_detail

        details = status_detail(args.directory, args.manifest, args.selectors)
        if args.json:
            print_json({"actions": [d.to_json() for d in details]}, command="status")
        else:
            print("\n".join(detail_lines(details)))
        return 0
    from epbuild.api import status

    cache = checks.cache_option(args)
    result = status(args.directory, args.manifest, args.selectors, cache=cache)
    if args.json:
        print_json(result.to_json(), command="status")
    elif args.graph:
        print(render.graph_text(result, args.graph))
    else:
        sys.stdout.write("".join(f"{line}\n" for line in status_lines(result)))
    return 0


def _clean(args: argparse.Namespace) -> int:
    from epbuild.api import clean

    removed = clean(args.directory, args.manifest, args.selectors, orphaned=args.orphaned)
    if args.json:
        print_json({"removed": list(removed)}, command="clean")
    else:
        print(f"epbuild: removed {len(removed)} file(s)")
    return 0


def _report(args: argparse.Namespace) -> int:
    from epbuild.inspection.html import write_html_report

    if args.out is None:
        raise UserError(
            "report needs -o/--out FILE: the HTML page to write (formerly --html FILE)",
            hint="epbuild report -o report.html",
        )
    html = checks.output_file(args.out, "-o/--out")
    count = write_html_report(args.directory, args.manifest, args.selectors, html)
    if args.json:
        print_json({"path": html, "actions": count}, command="report")
    else:
        print(f"epbuild: wrote {html} ({count} action(s))")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from epbuild.inspection.verify import verify_outputs

    if args.timeout is not None and not args.generate:
        raise UserError("--timeout applies to verify --generate only", hint="add --generate")
    limit = checks.timeout(args.timeout, "--timeout", GENERATE_TIMEOUT)
    result = verify_outputs(
        args.directory,
        args.manifest,
        args.selectors,
        load=args.load,
        numerics=args.numerics,
        jobs=args.jobs,
        generate=args.tokens if args.generate else None,
        prompt=args.prompt,
        generate_timeout=limit,
    )
    if args.json:
        print_json(result.to_json(), command="verify", ok=result.ok)
    else:
        print("\n".join(render.verify_lines(result, load=args.load)))
    return 0 if result.ok else 1


def _package(args: argparse.Namespace) -> int:
    from epbuild.frontends.progress import ConsoleReporter
    from epbuild.shipping.package import package

    # With --json, only notes (a lock waited for) reach stderr.
    reporter = ConsoleReporter(quiet=args.json)
    build_options = {
        "jobs": checks.check_jobs(args.jobs),
        "keep_going": args.keep_going,
        "cache": checks.cache_option(args),
    }
    if not args.build and (args.jobs or args.keep_going or args.cache or args.no_cache):
        raise UserError("-j, -k and the cache flags apply to package --build only")
    result = package(
        args.directory,
        args.manifest,
        args.selectors,
        args.out,
        build=args.build,
        check="hash" if args.hash else "stat",
        reporter=reporter,
        build_options=build_options,
        lock_timeout=checks.seconds(args.lock_timeout, "--lock-timeout"),
        force=args.force,
    )
    if args.json:
        print_json(result.to_json(), command="package")
    else:
        print("\n".join(render.package_lines(result)))
    return 0


def _toolchains(args: argparse.Namespace) -> int:
    from epbuild.frontends.toolchain_cli import run_toolchains_command

    return run_toolchains_command(args)


def _lock(args: argparse.Namespace) -> int:
    from epbuild.frontends.lock_cli import run_lock_command

    return run_lock_command(args)


def _cache(args: argparse.Namespace) -> int:
    from epbuild.frontends.cache_cli import run_cache_command

    return run_cache_command(args)


def _schema(args: argparse.Namespace) -> int:
    """The manifest's JSON Schema on stdout (the file the wheel ships, which is the one in
    ``schemas/``); how to use it on stderr, or both in one document under ``--json``."""
    import json
    import sys

    from epbuild.frontends.parser import SCHEMA_LINE
    from epbuild.manifest.schema import shipped_schema

    text = shipped_schema()
    if args.json:
        print_json({"schema": json.loads(text), "editor_line": SCHEMA_LINE}, command="schema")
        return 0
    sys.stdout.write(text)
    print(
        "epbuild: save it beside the manifest (epbuild schema > epbuild.schema.json) and make "
        f"this the manifest's first line: {SCHEMA_LINE}",
        file=sys.stderr,
    )
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "build": run_build,
    "status": _status,
    "init": run_init,
    "add": run_add,
    "clean": _clean,
    "verify": _verify,
    "package": _package,
    "report": _report,
    "watch": run_watch,
    "cache": _cache,
    "toolchains": _toolchains,
    "lock": _lock,
    "schema": _schema,
}
"""Command name → its function (``main`` looks the parsed command up here)."""
