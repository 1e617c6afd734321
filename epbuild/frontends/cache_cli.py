"""``epbuild cache CACHE_COMMAND``: the library's cache operations (``cache/operations``)
called with the command line's arguments, and their results rendered."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict

from epbuild.cache.operations import (
    cache_key,
    export_cache,
    import_cache,
    prune_cache,
    verify_cache,
)
from epbuild.frontends.args import size_option
from epbuild.frontends.render import print_json


def _say(line: str) -> None:
    print(f"epbuild: {line}", file=sys.stderr)


def _print_key(args: argparse.Namespace) -> int:
    key = cache_key(args.directory, args.manifest, args.selectors, say=_say)
    if args.json:
        print_json({"key": key}, command="cache key")
    else:
        print(key)
    return 0


def _print_export(args: argparse.Namespace) -> int:
    report = export_cache(
        args.file, args.directory, args.manifest, args.selectors, cache=args.cache, say=_say
    )
    summary = (
        f"epbuild: wrote {args.file}: {report.entries} entr(ies), {report.objects} object(s), "
        f"{report.bytes} bytes"
    )
    if args.json:
        doc = {"path": args.file, **asdict(report)}
        print_json(doc, command="cache export", ok=not report.missing)
    return _summary(args, summary, report.missing, "missing ")


def _print_import(args: argparse.Namespace) -> int:
    report = import_cache(args.file, args.directory, args.manifest, cache=args.cache)
    summary = (
        f"epbuild: imported {report.entries} entr(ies), {report.objects} object(s), "
        f"{report.bytes} bytes from {args.file}"
    )
    if args.json:
        doc = {k: v for k, v in asdict(report).items() if k != "problems"}
        doc = {"path": args.file, **doc, "warnings": list(report.problems)}
        print_json(doc, command="cache import", ok=not report.problems)
    return _summary(args, summary, report.problems, "not imported: ")


def _print_verify(args: argparse.Namespace) -> int:
    checked = verify_cache(args.directory, args.manifest, cache=args.cache)
    summary = (
        f"epbuild: checked {checked.objects} object(s), {checked.bytes} bytes, of "
        f"{checked.entries} entr(ies); {len(checked.problems)} discarded"
    )
    if args.json:
        doc = {k: v for k, v in asdict(checked).items() if k != "problems"}
        doc["discarded"] = list(checked.problems)
        print_json(doc, command="cache verify", ok=not checked.problems)
    return _summary(args, summary, checked.problems, "")


def _summary(args: argparse.Namespace, summary: str, problems: list[str], prefix: str) -> int:
    """Unless ``--json``: ``summary``, then each of ``problems`` on stderr (after
    ``prefix``); exit 1 when there are problems."""
    if not args.json:
        print(summary)
        for line in problems:
            print(f"epbuild: {prefix}{line}", file=sys.stderr)
    return 1 if problems else 0


def _print_prune(args: argparse.Namespace) -> int:
    limit = size_option(args.max_size, "--max-size", "10G or 500M")
    pruned = prune_cache(limit, args.directory, args.manifest, cache=args.cache)
    if args.json:
        print_json(asdict(pruned), command="cache prune")
        return 0
    print(
        f"epbuild: removed {pruned.entries_removed} entr(ies) ({pruned.bytes_removed} bytes), "
        f"kept {pruned.entries_kept} ({pruned.bytes_kept} bytes)"
    )
    for line in pruned.warnings:
        print(f"epbuild: warning: {line}", file=sys.stderr)
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "key": _print_key,
    "export": _print_export,
    "import": _print_import,
    "verify": _print_verify,
    "prune": _print_prune,
}


def run_cache_command(args: argparse.Namespace) -> int:
    """Run ``epbuild cache CACHE_COMMAND`` and render its result; returns the exit code."""
    return _COMMANDS[args.cache_command](args)
