"""The ``epbuild`` command line: parse arguments, call the API, render, map exit codes.

Exit codes: 0 success, 1 build failure, 2 user error, 3 lock timeout, 130 interrupted.
Kept cheap to import: ``epbuild build`` with nothing to do answers from the no-op fast path
before the API (or anything heavier) is loaded.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends import failures, render
from epbuild.frontends.parser import build_parser
from epbuild.frontends.render import print_json, status_lines, summary_line

if TYPE_CHECKING:
    from epbuild.frontends.watch import Cycle
    from epbuild.results import BuildResult

_parser = build_parser
"""The parser (``epbuild.frontends.parser.build_parser``), under the name the reference
generator and older callers use."""


def _build_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build``'s keyword arguments to the API, every argument checked."""
    return {
        "jobs": checks.check_jobs(args.jobs),
        "keep_going": args.keep_going,
        "dry_run": args.dry_run,
        "lock_timeout": checks.seconds(args.lock_timeout, "--lock-timeout"),
        "cache": checks.cache_option(args),
        "cache_only": args.cache_only,
        "cache_push": args.cache_push,
        "memory_budget": checks.memory_budget(args.memory_budget),
        "trace": args.trace,
        "executor": args.executor,
        "scheduler": checks.scheduler(args.scheduler),
        "locked": _locked(args),
    }


def _locked(args: argparse.Namespace) -> bool:
    """``--locked``, or ``EPBUILD_LOCKED=1`` (for CI); read here, off the no-op path's
    imports."""
    value = os.environ.get("EPBUILD_LOCKED", "").strip().lower()
    return bool(args.locked) or value in ("1", "true", "yes")


def _answered_by_noop(args: argparse.Namespace) -> bool:
    """Print the recorded result if nothing changed since an all-up-to-date build (``noop``)."""
    if args.dry_run or args.trace or _locked(args):
        return False  # --locked compares the environments with the lock: the full path
    import time

    from epbuild.planning.noop import fast_noop

    t0 = time.perf_counter()
    doc = fast_noop(args.directory, args.manifest, args.selectors)
    if doc is None:
        return False
    doc["summary"]["seconds"] = round(time.perf_counter() - t0, 3)
    if args.numerics:
        doc["numerics"] = []  # nothing was built, so nothing to check
    if args.json:
        print_json(doc, command="build")
    else:
        print(summary_line(doc["summary"]))
    return True


def _render_build(args: argparse.Namespace, result: BuildResult) -> None:
    from epbuild.results import Outcome

    doc = result.to_json()
    if args.json:
        print_json(doc, command="build", ok=result.exit_code == 0)
        return
    for a in result.actions:
        if a.outcome is Outcome.WOULD_BUILD:
            print(f"would build {a.id}: {'; '.join(a.reasons)}")
    print(summary_line(doc["summary"]))


def _cmd_build(args: argparse.Namespace) -> int:
    options = _build_options(args)  # before the fast path: a bad argument is always exit 2
    if _answered_by_noop(args):
        return 0
    from epbuild.api import build
    from epbuild.frontends.progress import ConsoleReporter

    result = build(
        args.directory, args.manifest, args.selectors, reporter=ConsoleReporter(), **options
    )
    if not args.numerics:
        _render_build(args, result)
        return result.exit_code
    from epbuild.inspect.numerics import NumericsStatus, check_numerics
    from epbuild.results import Outcome

    built = [a.id for a in result.actions if a.outcome in (Outcome.COMPILED, Outcome.RESTORED)]
    checks = check_numerics(args.directory, args.manifest, built) if built else []
    failed = any(c.status is NumericsStatus.FAILED for c in checks)
    code = result.exit_code or (1 if failed else 0)
    if args.json:
        doc = {**result.to_json(), "numerics": [c.to_json() for c in checks]}
        print_json(doc, command="build", ok=code == 0)
    else:
        _render_build(args, result)
        for c in checks:
            print(c.line())
    return code


def _cmd_status(args: argparse.Namespace) -> int:
    if args.detail and (args.cache or args.no_cache):
        raise UserError(
            "status --detail reads the built outputs, not the cache: --cache and --no-cache "
            "do not apply",
            hint="drop the cache option, or leave out --detail",
        )
    if args.detail:
        from epbuild.inspect.detail import render, status_detail

        details = status_detail(args.directory, args.manifest, args.selectors)
        if args.json:
            print_json({"actions": [d.to_json() for d in details]}, command="status")
        else:
            print("\n".join(render(details)))
        return 0
    from epbuild.api import status

    cache = checks.cache_option(args)
    result = status(args.directory, args.manifest, args.selectors, cache=cache)
    if args.json:
        print_json(result.to_json(), command="status")
    else:
        for line in status_lines(result):
            print(line)
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    if args.source is None:
        from epbuild.manifest.init import init

        if args.target:
            raise UserError("--target needs --from DIR")
        path = init(args.directory, args.manifest)
        if args.json:
            print_json({"path": path, "groups": [], "skipped": []}, command="init")
        else:
            print(f"epbuild: wrote {path}")
        return 0
    from epbuild.manifest.init import init_from

    result = init_from(args.directory, args.manifest, source=args.source, target=args.target)
    if args.json:
        groups = [
            {"name": g.name, "models": list(g.models), "share_weights": g.share_weights}
            for g in result.groups
        ]
        doc = {"path": result.path, "groups": groups, "skipped": list(result.skipped)}
        print_json(doc, command="init")
        return 0
    for line in result.lines():
        print(f"epbuild: {line}")
    return 0


def _list_targets(asked: bool, as_json: bool) -> int:
    from epbuild.providers.qnn import WELL_KNOWN_TARGETS

    if not asked:
        raise UserError("add target needs a TARGET", hint="epbuild add target --list")
    if as_json:
        targets = [
            {"name": n, "title": t.title, "htp_arch": t.htp_arch, "soc_model": t.soc_model}
            for n, t in WELL_KNOWN_TARGETS.items()
        ]
        print_json({"targets": targets}, command="add")
        return 0
    for name, t in WELL_KNOWN_TARGETS.items():
        print(f"{name:<26} {t.title}: htp_arch {t.htp_arch}, soc_model {t.soc_model}")
    print("(part numbers work too: epbuild add target sm8650)")
    return 0


def _cmd_add(args: argparse.Namespace) -> int:
    from epbuild.manifest import edit

    where = (args.directory, args.manifest)
    if args.add_command == "model":
        result = edit.add_models(
            *where,
            models=args.paths,
            group=args.group,
            providers=args.provider,
            share_weights=args.share_weights,
        )
    elif args.add_command == "provider":
        options = checks.provider_options(args.option)
        toolchain = (
            {"requirements": args.requirement}
            if args.requirement
            else {"python": args.python}
            if args.python is not None
            else None
        )
        result = edit.add_provider(
            *where,
            name=args.name,
            ep=args.ep,
            options=options,
            replace=args.replace,
            toolchain=toolchain,
        )
    elif args.list or args.target is None:
        return _list_targets(args.list, args.json)
    else:
        options = checks.provider_options(args.option)
        result = edit.add_target(
            *where,
            target=args.target,
            ep=args.ep,
            options=options,
            to=args.group,
            name=args.provider,
            replace=args.replace,
        )
    if args.json:
        doc = {
            "path": result.path,
            "written": result.written,
            "changes": list(result.changes),
            "notes": list(result.notes),
        }
        print_json(doc, command="add")
        return 0
    for line in (*result.changes, *result.notes):
        print(f"epbuild: {line}")
    print(f"epbuild: wrote {result.path}" if result.written else "epbuild: nothing to change")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from epbuild.api import clean

    removed = clean(args.directory, args.manifest, args.selectors)
    if args.json:
        print_json({"removed": list(removed)}, command="clean")
    else:
        print(f"epbuild: removed {len(removed)} file(s)")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from epbuild.inspect.html import write_html_report

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


def _cmd_verify(args: argparse.Namespace) -> int:
    from epbuild.inspect.verify import verify_outputs

    result = verify_outputs(
        args.directory,
        args.manifest,
        args.selectors,
        load=args.load,
        numerics=args.numerics,
        jobs=args.jobs,
        generate=args.tokens if args.generate else None,
        prompt=args.prompt,
    )
    if args.json:
        print_json(result.to_json(), command="verify", ok=result.ok)
        return 0 if result.ok else 1
    for line in result.lines():
        print(line)
    for c in result.loads:
        if c.outcome.value == "not_loadable_here":
            print(f"{c.file}: not loadable here: {c.message}")
    for n in result.numerics:
        if n.status.value != "failed":
            print(n.line())
    for g in result.generations or ():
        if g.status.value != "failed":
            print(g.line())
    passed = sum(1 for c in result.loads if c.outcome.value == "passed")
    loads = f", {passed} loaded and matched the CPU EP" if args.load else ""
    lines = result.lines()
    warned = sum(1 for line in lines if line.startswith("warning: "))
    also = f", {warned} warning(s)" if warned else ""
    print(
        f"epbuild: verified {len(result.checked)} model(s){loads}: "
        f"{len(lines) - warned} problem(s){also}"
    )
    return 0 if result.ok else 1


def _cmd_package(args: argparse.Namespace) -> int:
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
        return 0
    s, files = result.stats, len(result.deployment["files"])
    if s.removed:
        print(f"epbuild: --force: deleted {', '.join(s.removed)} from {result.path}")
    what = f"{len(result.components)} component(s), {files} file(s)"
    if s.unchanged:
        print(f"epbuild: {result.path} is up to date ({what})")
    else:
        how = f"{len(s.linked)} linked from the outputs, {len(s.kept)} kept, "
        print(f"epbuild: packaged {what} into {result.path} ({how}{len(s.copied)} copied)")
    names = ", ".join(f"{n} ({p})" for p, n in result.deployment.get("ep_names", {}).items())
    print(
        f"epbuild: apps select its variants by registering the execution provider as {names} "
        "([package] ep_names sets another name)"
    )
    return 0


def _watch_started(as_json: bool, c: Cycle) -> None:
    if not as_json:
        what = "initial build" if c.number == 1 else ", ".join(c.changed) + " changed"
        print(f"epbuild watch: {what}", flush=True)


def _watch_finished(as_json: bool, c: Cycle) -> None:
    if as_json:
        render.print_json_line(c.to_json(), command="watch", ok=c.ok)
        return
    for err in (c.manifest_error, c.error):
        if err:
            print(f"epbuild: error: {err}", file=sys.stderr)
    if c.manifest_error:
        print("epbuild watch: keeping the last good manifest", file=sys.stderr, flush=True)
    if c.result is not None:
        print(summary_line(c.result.summary()), flush=True)


def _watch_message(text: str) -> None:
    print(f"epbuild watch: {text}", file=sys.stderr, flush=True)


def _cmd_watch(args: argparse.Namespace) -> int:
    from epbuild.frontends.progress import ConsoleReporter
    from epbuild.frontends.watch import watch

    watch(
        args.directory,
        args.manifest,
        args.selectors,
        debounce=args.debounce,
        jobs=checks.check_jobs(args.jobs),
        lock_timeout=checks.seconds(args.lock_timeout, "--lock-timeout"),
        cache=checks.cache_option(args),
        poll=args.poll,
        reporter_factory=ConsoleReporter,
        on_start=functools.partial(_watch_started, args.json),
        on_cycle=functools.partial(_watch_finished, args.json),
        on_message=_watch_message,
    )
    return 0


def _cmd_toolchains(args: argparse.Namespace) -> int:
    from epbuild.frontends.toolchain_cli import run_toolchains_command

    return run_toolchains_command(args)


def _cmd_lock(args: argparse.Namespace) -> int:
    from epbuild.frontends.lock_cli import run_lock_command

    return run_lock_command(args)


def _cmd_cache(args: argparse.Namespace) -> int:
    from epbuild.frontends.cache_cli import run_cache_command

    return run_cache_command(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "build": _cmd_build,
    "status": _cmd_status,
    "init": _cmd_init,
    "add": _cmd_add,
    "clean": _cmd_clean,
    "verify": _cmd_verify,
    "package": _cmd_package,
    "report": _cmd_report,
    "watch": _cmd_watch,
    "cache": _cmd_cache,
    "toolchains": _cmd_toolchains,
    "lock": _cmd_lock,
}


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (also used as the console script).

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
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        args = _parser().parse_args(argv)
        command, directory = _command_name(args), args.directory
        debug = debug or args.debug
        notes = list(getattr(args, "deprecated", None) or [])
        render.command_notes(notes)
        if directory != "." and not os.path.isdir(directory):
            raise UserError(f"-C {directory}: no such directory")
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


_NESTED = {
    "build": (), "status": (), "init": (), "add": (),
    "clean": (), "verify": (), "package": (), "report": (), "watch": (),
    "cache": ("key", "export", "import", "prune", "verify"), "toolchains": (), "lock": (),
}  # fmt: skip
"""Each command and its sub-commands, for naming a command whose arguments did not parse."""


def _command_name(args: argparse.Namespace) -> str:
    """``build``, ``cache key``, ``add model``: the ``command`` of the JSON documents."""
    sub = getattr(args, "cache_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


if __name__ == "__main__":
    sys.exit(main())
