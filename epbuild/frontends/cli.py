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
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

from epbuild.errors import UsageError, UserError
from epbuild.frontends import args as checks
from epbuild.frontends import failures, render
from epbuild.frontends.render import print_json, status_lines, summary_line

if TYPE_CHECKING:
    from epbuild.frontends.watch import Cycle
    from epbuild.results import BuildResult

    _Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _selectors(p: argparse.ArgumentParser, text: str | None = None) -> None:
    p.add_argument("selectors", nargs="*", metavar="SELECTOR", help=text)


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache", metavar="DIR|URL", help="cache directory or fsspec URL (s3://bucket/prefix)"
    )
    p.add_argument("--no-cache", action="store_true", help="neither restore nor store")


def _build_parser(sub: _Commands) -> None:
    b = sub.add_parser("build", help="compile stale actions")
    _selectors(b, "group, group/provider or id")
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
    b.add_argument(
        "--numerics",
        action="store_true",
        help="then compare each built model's outputs with its source's (verify --numerics)",
    )
    b.add_argument(
        "--locked",
        action="store_true",
        help="refuse (exit 2) when an environment differs from epbuild.lock (EPBUILD_LOCKED=1)",
    )
    b.add_argument("--executor", choices=("local", "dask"), help="where actions run")
    b.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler, tcp://HOST:PORT")


def _report_parser(sub: _Commands) -> None:
    r = sub.add_parser("report", help="per-action report of the last builds (HTML page)")
    _selectors(r)
    r.add_argument(
        "--html",
        metavar="FILE",
        required=True,
        help="write a self-contained HTML page (timeline + table)",
    )
    r.add_argument("--json", action="store_true", help=_JSON_HELP)


def _status_parser(sub: _Commands) -> None:
    s = sub.add_parser("status", help="list actions as up to date or stale, with reasons")
    _selectors(s)
    s.add_argument("--json", action="store_true")
    _cache_args(s)
    detail = "EPContext coverage, CPU fallback, sizes, time, memory"
    s.add_argument("--detail", action="store_true", help=detail)


def _verify_parser(sub: _Commands) -> None:
    v = sub.add_parser("verify", help="check built outputs (schema, paths, digests)")
    _selectors(v)
    v.add_argument("--json", action="store_true")
    v.add_argument("--load", action="store_true", help="also run each model vs the CPU EP")
    v.add_argument("-j", "--jobs", type=int, help="--load: models run at once ([workspace] jobs)")
    v.add_argument(
        "--numerics",
        action="store_true",
        help="compare each model's outputs with its source's (figures per output, tolerances "
        "from the manifest; recorded: a second run with nothing changed runs nothing)",
    )
    v.add_argument(
        "--generate",
        action="store_true",
        help="LLM packages: generate greedy tokens through the provider (onnxruntime-genai) "
        "and compare them with the CPU source's, step by step",
    )
    v.add_argument("--tokens", type=int, default=10, help="--generate: tokens (default 10)")
    v.add_argument("--prompt", help="--generate: the prompt (default a fixed sentence)")


def _package_parser(sub: _Commands) -> None:
    k = sub.add_parser("package", help="write built outputs as an ONNX Runtime model package")
    _selectors(k)
    k.add_argument("-o", "--out", metavar="DIR", help="package directory ([package] out_dir)")
    k.add_argument("--build", action="store_true", help="build stale actions first")
    k.add_argument("-j", "--jobs", type=int, help="with --build: compiles at once")
    k.add_argument("-k", "--keep-going", action="store_true", help="with --build: as build -k")
    _cache_args(k)
    k.add_argument("--hash", action="store_true", help="re-hash every output first")
    k.add_argument("--json", action="store_true", help="print the deployment manifest as JSON")
    k.add_argument(
        "--force",
        action="store_true",
        help="replace the package directory even if it holds files the package does not list "
        "(they are deleted)",
    )
    k.add_argument("--lock-timeout", type=float, metavar="SECONDS", help="give up waiting")


_JSON_HELP = "print one JSON object on stdout"


def _clean_parser(sub: _Commands) -> None:
    c = sub.add_parser("clean", help="remove built outputs and their records")
    _selectors(c)
    c.add_argument("--json", action="store_true", help=_JSON_HELP)


def _cache_parser(sub: _Commands) -> None:
    k = sub.add_parser("cache", help="the action cache: key, export, import, prune, verify")
    ks = k.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND")
    ks.required = True
    key = ks.add_parser("key", help="print a short key that changes when any action key does")
    _selectors(key)
    exp = ks.add_parser("export", help="write the entries this manifest needs to one archive")
    exp.add_argument("file", metavar="FILE", help="archive to write (.tar, or .tar.gz)")
    _selectors(exp)
    imp = ks.add_parser("import", help="add an exported archive to the local cache")
    imp.add_argument("file", metavar="FILE")
    prn = ks.add_parser("prune", help="evict least-recently-used entries")
    prn.add_argument("--max-size", required=True, metavar="SIZE", help="e.g. 10G, 500M")
    ver = ks.add_parser("verify", help="re-hash every cached object; discard damaged entries")
    for cmd in (exp, imp, prn, ver):
        cmd.add_argument("--cache", metavar="DIR|URL", help="the cache (default: configured)")
    for cmd in (key, exp, imp, prn, ver):
        cmd.add_argument("--json", action="store_true", help=_JSON_HELP)


def _watch_parser(sub: _Commands) -> None:
    w = sub.add_parser("watch", help="rebuild affected actions whenever their inputs change")
    _selectors(w)
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
    w.add_argument("--lock-timeout", type=float, metavar="SECONDS", help="give up waiting")
    _cache_args(w)


_OPTION_HELP = (
    "a provider option (repeatable); VALUE is written as an integer or boolean when it reads "
    "as one (75, true), else as a string; quote it to force a string (htp_arch='\"75\"')"
)


def _init_parser(sub: _Commands) -> None:
    i = sub.add_parser("init", help="write a commented starter epbuild.toml")
    i.add_argument(
        "--from",
        dest="source",
        metavar="DIR",
        help="list the models found under DIR; models sharing an external-data file "
        "become one weight-sharing group, the others one group per directory",
    )
    i.add_argument("--json", action="store_true", help=_JSON_HELP)
    i.add_argument(
        "--target",
        metavar="SOC",
        help="the provider (default htp-v73), e.g. "
        "snapdragon-8-gen-3 (list: 'epbuild add target --list')",
    )


def _add_parser(sub: _Commands) -> None:
    a = sub.add_parser(
        "add",
        help="add models, providers or targets to epbuild.toml "
        "(comments and layout kept; checked before writing)",
    )
    kinds = a.add_subparsers(dest="add_command", metavar="WHAT")
    kinds.required = True
    for add in (_add_model_parser, _add_provider_parser, _add_target_parser):
        add(kinds)
    for kind in kinds.choices.values():
        kind.add_argument("--json", action="store_true", help=_JSON_HELP)


def _add_model_parser(kinds: _Commands) -> None:
    m = kinds.add_parser("model", help="add models to a group (created when missing)")
    m.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="model files or globs, relative to the current directory (or -C DIR)",
    )
    m.add_argument("-g", "--group", help="the group (default: the only one)")
    m.add_argument(
        "-p",
        "--provider",
        action="append",
        default=[],
        metavar="NAME",
        help="provider to build the group for (repeatable; a new group defaults "
        "to the only provider)",
    )
    m.add_argument("--share-weights", action="store_true", help="set share_weights = true")


def _add_provider_parser(kinds: _Commands) -> None:
    p = kinds.add_parser("provider", help="define a named provider configuration")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--ep", required=True, help="adapter: qnn, openvino, tensorrt, plugin, ...")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help=_OPTION_HELP)
    p.add_argument("--replace", action="store_true", help="overwrite an existing provider")
    tc = p.add_mutually_exclusive_group()
    tc.add_argument(
        "--requirement",
        action="append",
        metavar="REQ",
        help="compile in a toolchain epbuild makes with these pip requirements (repeatable), "
        "e.g. onnxruntime-openvino==1.24.1",
    )
    tc.add_argument("--python", metavar="PATH", help="compile in this interpreter's environment")


def _add_target_parser(kinds: _Commands) -> None:
    t = kinds.add_parser(
        "target",
        help="build groups for one more target: a known SoC, or --ep and --option",
        description="Define a provider for TARGET and add it to groups' providers lists. "
        "TARGET is a Qualcomm SoC epbuild knows (its htp_arch and soc_model; --list shows "
        "them) or the name of a provider described with --ep and --option.",
    )
    t.add_argument(
        "target", nargs="?", metavar="TARGET", help="a known SoC, or a new provider's name"
    )
    t.add_argument("--list", action="store_true", help="list the SoCs epbuild knows")
    t.add_argument(
        "-g",
        "--group",
        "--to",  # its first name, kept working
        dest="to",
        action="append",
        default=[],
        metavar="GROUP",
        help="group to add it to (repeatable; default: every group)",
    )
    t.add_argument("--name", help="the provider's name (default: TARGET)")
    t.add_argument("--ep", help="adapter, for a TARGET that is not a known SoC")
    t.add_argument("--option", action="append", metavar="KEY=VALUE", help=_OPTION_HELP)
    t.add_argument(
        "--replace", action="store_true", help="overwrite a different provider of that name"
    )


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose complaints are raised (``UsageError``) rather than printed
    with an exit, so that ``main`` reports them like any other mistake (``--json`` too)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, usage=self.format_usage(), prog=self.prog)


def _parser() -> argparse.ArgumentParser:
    """Global options, then one sub-parser per command (in ``--help`` order)."""
    p = _Parser(prog="epbuild", description="Build ONNX Runtime EPContext models incrementally.")
    p.add_argument("-C", dest="directory", default=".", help="run as if started in DIR")
    p.add_argument("-f", "--file", dest="manifest", help="manifest file (default epbuild.toml)")
    p.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback an error came from (also EPBUILD_DEBUG=1)",
    )
    sub: _Commands = p.add_subparsers(  # type: ignore[assignment]  # its parsers are _Parser
        dest="command", metavar="COMMAND"
    )
    sub.required = True
    commands = (
        _init_parser,
        _add_parser,
        _build_parser,
        _report_parser,
        _status_parser,
        _verify_parser,
        _clean_parser,
    )
    for add in (*commands, _package_parser, _cache_parser, _toolchains_parser, _watch_parser):
        add(sub)
    from epbuild.frontends.lock_cli import lock_parser

    lock_parser(sub)
    return p


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
        print_json({"targets": targets}, command="add target")
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
            to=args.to,
            name=args.name,
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

    html = checks.output_file(args.html, "--html")
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


def _toolchains_parser(sub: _Commands) -> None:
    t = sub.add_parser(
        "toolchains",
        help="the environments made for providers' toolchains (per user); --prune",
    )
    t.add_argument(
        "--prune",
        action="store_true",
        help="remove the environments the current manifest does not use (all, without one) "
        "and other epbuild versions' worker copies; they are made again when needed",
    )
    t.add_argument("--json", action="store_true", help="print JSON")


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
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        args = _parser().parse_args(argv)
        command, directory = _command_name(args), args.directory
        debug = debug or args.debug
        if directory != "." and not os.path.isdir(directory):
            raise UserError(f"-C {directory}: no such directory")
        return COMMANDS[args.command](args)
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
    "build": (), "status": (), "init": (), "add": ("model", "provider", "target"),
    "clean": (), "verify": (), "package": (), "report": (), "watch": (),
    "cache": ("key", "export", "import", "prune", "verify"), "toolchains": (), "lock": (),
}  # fmt: skip
"""Each command and its sub-commands, for naming a command whose arguments did not parse."""


def _command_name(args: argparse.Namespace) -> str:
    """``build``, ``cache key``, ``add model``: the ``command`` of the JSON documents."""
    sub = getattr(args, "cache_command", None) or getattr(args, "add_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


if __name__ == "__main__":
    sys.exit(main())
