"""The ``epbuild`` command line: parse arguments, call the API, render, map exit codes.

Exit codes: 0 success, 1 build failure, 2 user error, 3 lock timeout, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from epbuild.errors import EpbuildError, UserError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epbuild", description="Build ONNX Runtime EPContext models incrementally."
    )
    p.add_argument("-C", dest="directory", default=".", help="run as if started in DIR")
    p.add_argument("-f", "--file", dest="manifest", help="manifest file (default epbuild.toml)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    sub.add_parser("init", help="write a commented starter epbuild.toml")

    b = sub.add_parser("build", help="compile stale actions")
    b.add_argument("selectors", nargs="*", metavar="SELECTOR", help="group, group/provider or id")
    b.add_argument("-j", "--jobs", type=int, help="compiles at once")
    b.add_argument("-k", "--keep-going", action="store_true", help="continue after failures")
    b.add_argument("-n", "--dry-run", action="store_true", help="show what would be built")
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    b.add_argument("--lock-timeout", type=float, metavar="SECONDS", help="give up waiting")
    _cache_args(b)
    b.add_argument(
        "--cache-only",
        action="store_true",
        help="restore from the cache or fail (exit 1): never compile",
    )
    b.add_argument(
        "--cache-push",
        action="store_true",
        help="also write compiled actions to the remote cache (--cache URL)",
    )
    b.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory local compiles may use at once, e.g. 8G (default: 3/4 of RAM)",
    )
    b.add_argument("--trace", metavar="FILE", help="write the timeline as Chrome trace JSON")
    b.add_argument("--executor", choices=("local", "dask"), help="where actions run")
    b.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler, tcp://HOST:PORT")

    r = sub.add_parser("report", help="per-action report of the last builds (HTML page)")
    r.add_argument("selectors", nargs="*", metavar="SELECTOR")
    r.add_argument(
        "--html",
        metavar="FILE",
        required=True,
        help="write a self-contained HTML page (timeline + table)",
    )

    s = sub.add_parser("status", help="list actions as up to date or stale, with reasons")
    s.add_argument("selectors", nargs="*", metavar="SELECTOR")
    s.add_argument("--json", action="store_true")
    _cache_args(s)
    s.add_argument("--detail", action="store_true",
                   help="EPContext coverage, CPU fallback, sizes, time, memory")  # fmt: skip

    v = sub.add_parser("verify", help="check built outputs (schema, paths, digests)")
    v.add_argument("selectors", nargs="*", metavar="SELECTOR")
    v.add_argument("--json", action="store_true")
    v.add_argument("--load", action="store_true", help="also run each model vs the CPU EP")

    c = sub.add_parser("clean", help="remove built outputs and their records")
    c.add_argument("selectors", nargs="*", metavar="SELECTOR")

    k = sub.add_parser("cache", help="the action cache: key, export, import, prune, verify")
    ks = k.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND")
    ks.required = True
    key = ks.add_parser("key", help="print a short key that changes when any action key does")
    key.add_argument("selectors", nargs="*", metavar="SELECTOR")
    exp = ks.add_parser("export", help="write the entries this manifest needs to one archive")
    exp.add_argument("file", metavar="FILE", help="archive to write (.tar, or .tar.gz)")
    exp.add_argument("selectors", nargs="*", metavar="SELECTOR")
    imp = ks.add_parser("import", help="add an exported archive to the local cache")
    imp.add_argument("file", metavar="FILE")
    prn = ks.add_parser("prune", help="evict least-recently-used entries")
    prn.add_argument("--max-size", required=True, metavar="SIZE", help="e.g. 10G, 500M")
    ver = ks.add_parser("verify", help="re-hash every cached object; discard damaged entries")
    for cmd in (exp, imp, prn, ver):
        cmd.add_argument("--cache", metavar="DIR|URL", help="the cache (default: configured)")

    w = sub.add_parser("watch", help="rebuild affected actions whenever their inputs change")
    w.add_argument("selectors", nargs="*", metavar="SELECTOR")
    w.add_argument("-j", "--jobs", type=int, help="compiles at once")
    w.add_argument(
        "--debounce",
        type=float,
        default=0.3,
        metavar="SECONDS",
        help="quiet time before a burst of changes is built (default 0.3)",
    )
    w.add_argument(
        "--poll", action="store_true", help="poll instead of inotify (network file systems)"
    )
    w.add_argument("--json", action="store_true", help="one JSON object per cycle on stdout")
    return p


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print_summary(doc: dict[str, Any]) -> None:
    from epbuild.results import Outcome

    s = doc["summary"]
    parts = [f"{s[o.value]} {o.value.replace('_', ' ')}" for o in Outcome if s.get(o.value)]
    print(f"epbuild: {', '.join(parts) or 'nothing to do'} in {s['seconds']:.2f}s")


def _fast_noop(args: argparse.Namespace) -> dict[str, Any] | None:
    """The recorded result when nothing changed since an all-up-to-date build (``noop``)."""
    if args.dry_run or args.trace:
        return None
    import time

    from epbuild.planning.noop import fast_noop

    t0 = time.perf_counter()
    doc = fast_noop(args.directory, args.manifest, args.selectors)
    if doc is not None:
        doc["summary"]["seconds"] = round(time.perf_counter() - t0, 3)
    return doc


def _cmd_build(args: argparse.Namespace) -> int:
    doc = _fast_noop(args)
    if doc is not None:
        if args.json:
            _print_json(doc)
        else:
            print(f"epbuild: {doc['summary']['up_to_date']} up to date in "
                  f"{doc['summary']['seconds']:.2f}s")  # fmt: skip
        return 0
    from epbuild.api import Outcome, build
    from epbuild.frontends.progress import ConsoleReporter

    if args.jobs is not None and args.jobs < 1:
        raise UserError("-j must be at least 1")
    budget = None
    if args.memory_budget is not None:
        from epbuild.errors import ManifestError
        from epbuild.manifest.load import parse_memory

        try:
            budget = parse_memory(args.memory_budget, key="--memory-budget")
        except ManifestError:
            raise UserError(f"--memory-budget {args.memory_budget!r} is not a size",
                            hint="write e.g. 8G or 512M") from None  # fmt: skip
        if budget <= 0:
            raise UserError("--memory-budget must be positive", hint="write e.g. 8G or 512M")
    result = build(
        args.directory,
        args.manifest,
        args.selectors,
        jobs=args.jobs,
        keep_going=args.keep_going,
        dry_run=args.dry_run,
        reporter=ConsoleReporter(),
        lock_timeout=args.lock_timeout,
        cache=_cache_option(args),
        cache_only=args.cache_only,
        cache_push=args.cache_push,
        memory_budget=budget,
        trace=args.trace,
        executor=args.executor,
        scheduler=args.scheduler,
    )
    if args.json:
        _print_json(result.to_json())
    else:
        if args.dry_run:
            for a in result.actions:
                if a.outcome is Outcome.WOULD_BUILD:
                    print(f"would build {a.id}: {'; '.join(a.reasons)}")
        _print_summary(result.to_json())
    return result.exit_code


def _cmd_status(args: argparse.Namespace) -> int:
    from epbuild.api import status

    if args.detail:
        from epbuild.inspect.detail import render, status_detail

        details = status_detail(args.directory, args.manifest, args.selectors)
        if args.json:
            _print_json({"actions": [d.to_json() for d in details]})
        else:
            print("\n".join(render(details)))
        return 0
    plans = status(args.directory, args.manifest, args.selectors, cache=_cache_option(args))
    if args.json:
        _print_json(
            {
                "actions": [
                    {
                        "id": p.action.id,
                        "group": p.action.group.name,
                        "provider": p.action.provider.name,
                        "stale": p.stale,
                        "reasons": p.reasons,
                        "key": p.key.key if p.key else None,
                    }
                    for p in plans
                ]
            }
        )
        return 0
    for p in plans:
        if p.stale:
            print(f"stale       {p.action.id}")
            for r in p.reasons:
                print(f"              - {r}")
        else:
            print(f"up to date  {p.action.id}")
    if not args.selectors:
        from epbuild.api import orphaned

        for action_id in orphaned(args.directory, args.manifest):
            print(f"orphaned    {action_id}")
            print("              - no longer in the manifest; 'epbuild clean' removes its outputs")
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    from epbuild.manifest.init import init

    path = init(args.directory, args.manifest)
    print(f"epbuild: wrote {path}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from epbuild.api import clean

    removed = clean(args.directory, args.manifest, args.selectors)
    print(f"epbuild: removed {len(removed)} file(s)")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from epbuild.inspect.html import write_html_report

    count = write_html_report(args.directory, args.manifest, args.selectors, args.html)
    print(f"epbuild: wrote {args.html} ({count} action(s))")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from epbuild.inspect.verify import verify_outputs

    result = verify_outputs(args.directory, args.manifest, args.selectors, load=args.load)
    if args.json:
        _print_json(result.to_json())
    else:
        for line in result.lines():
            print(line)
        for c in result.loads:
            if c.outcome.value == "not_loadable_here":
                print(f"{c.file}: not loadable here: {c.message}")
        passed = sum(1 for c in result.loads if c.outcome.value == "passed")
        loads = f", {passed} loaded and matched the CPU EP" if args.load else ""
        print(f"epbuild: verified {len(result.checked)} model(s){loads}: "
              f"{len(result.lines())} problem(s)")  # fmt: skip
    return 0 if result.ok else 1


def _cmd_watch(args: argparse.Namespace) -> int:
    from epbuild.frontends.progress import ConsoleReporter
    from epbuild.frontends.watch import Cycle, watch

    if args.jobs is not None and args.jobs < 1:
        raise UserError("-j must be at least 1")

    def started(c: Cycle) -> None:
        if not args.json:
            what = "initial build" if c.number == 1 else ", ".join(c.changed) + " changed"
            print(f"epbuild watch: {what}", flush=True)

    def show(c: Cycle) -> None:
        if args.json:
            print(json.dumps(c.to_json()), flush=True)
            return
        for err in (c.manifest_error, c.error):
            if err:
                print(f"epbuild: error: {err}", file=sys.stderr)
        if c.manifest_error:
            print("epbuild watch: keeping the last good manifest", file=sys.stderr, flush=True)
        if c.result is not None:
            s = c.result.summary()
            parts = [f"{s[o]} {o.replace('_', ' ')}" for o in s if o not in ("total", "seconds")
                     and s[o]]  # fmt: skip
            print(f"epbuild: {', '.join(parts) or 'nothing to do'} in {c.result.seconds:.2f}s",
                  flush=True)  # fmt: skip

    watch(
        args.directory, args.manifest, args.selectors, debounce=args.debounce, jobs=args.jobs,
        poll=args.poll, reporter_factory=ConsoleReporter, on_start=started, on_cycle=show,
        on_message=lambda text: print(f"epbuild watch: {text}", file=sys.stderr, flush=True),
    )  # fmt: skip
    return 0


COMMANDS = {"build": _cmd_build, "status": _cmd_status, "init": _cmd_init, "clean": _cmd_clean,
            "verify": _cmd_verify, "report": _cmd_report, "watch": _cmd_watch}  # fmt: skip


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache", metavar="DIR|URL", help="cache directory or fsspec URL (s3://bucket/prefix)"
    )
    p.add_argument("--no-cache", action="store_true", help="neither restore nor store")


def _cache_option(args: argparse.Namespace) -> str | bool | None:
    if args.no_cache and args.cache:
        raise UserError("--cache and --no-cache contradict each other")
    return False if args.no_cache else args.cache


def _cmd_cache(args: argparse.Namespace) -> int:
    from epbuild.frontends import cache_cli as commands

    where = (args.directory, args.manifest)
    if args.cache_command == "key":
        print(commands.cache_key(*where, args.selectors))
        return 0
    if args.cache_command == "export":
        report, missing = commands.export_cache(args.file, *where, args.selectors,
                                                cache=args.cache)  # fmt: skip
        print(f"epbuild: wrote {args.file}: {report.entries} entr(ies), {report.objects} "
              f"object(s), {report.bytes} bytes")  # fmt: skip
        for line in missing:
            print(f"epbuild: missing {line}", file=sys.stderr)
        return 1 if missing else 0
    if args.cache_command == "import":
        report = commands.import_cache(args.file, *where, cache=args.cache)
        print(f"epbuild: imported {report.entries} entr(ies), {report.objects} object(s), "
              f"{report.bytes} bytes from {args.file}")  # fmt: skip
        for line in report.problems:
            print(f"epbuild: warning: {line}", file=sys.stderr)
        return 1 if report.problems else 0
    if args.cache_command == "verify":
        checked = commands.verify_cache(*where, cache=args.cache)
        print(f"epbuild: checked {checked.objects} object(s), {checked.bytes} bytes, of "
              f"{checked.entries} entr(ies); {len(checked.problems)} discarded")  # fmt: skip
        for line in checked.problems:
            print(f"epbuild: {line}", file=sys.stderr)
        return 1 if checked.problems else 0
    from epbuild.errors import ManifestError
    from epbuild.manifest.load import parse_memory

    try:
        limit = parse_memory(args.max_size, key="--max-size")
    except ManifestError:
        raise UserError(f"--max-size {args.max_size!r} is not a size",
                        hint="write e.g. 10G or 500M") from None  # fmt: skip
    pruned = commands.prune_cache(limit, *where, cache=args.cache)
    print(f"epbuild: removed {pruned.entries_removed} entr(ies) ({pruned.bytes_removed} bytes), "
          f"kept {pruned.entries_kept} ({pruned.bytes_kept} bytes)")  # fmt: skip
    return 0


COMMANDS["cache"] = _cmd_cache


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (also used as the console script)."""
    args = _parser().parse_args(argv)
    if args.directory != "." and not os.path.isdir(args.directory):
        print(f"epbuild: error: -C {args.directory}: no such directory", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        return COMMANDS[args.command](args)
    except EpbuildError as exc:
        print(f"epbuild: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("epbuild: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
