"""The ``epbuild cache`` commands: library calls (key, export, import, prune, verify) and
their command-line rendering (:func:`run_cache_command`)."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from epbuild.cache.archive import ArchiveReport, export_entries, import_archive
from epbuild.cache.location import open_cache
from epbuild.cache.prune import PruneReport, prune
from epbuild.cache.trust import CacheVerifyReport, verify_all
from epbuild.errors import UserError
from epbuild.frontends.render import print_json

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.planning.workspace import Workspace


def _open(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    selectors: list[str] | tuple[str, ...] = (),
) -> Workspace:
    from epbuild.planning.workspace import open_workspace
    from epbuild.toolchains.resolve import Toolchains

    # Keys need the providers' toolchain versions: make a missing toolchain, as build would
    # (`cache key` on a fresh CI runner runs before any build).
    def say(line: str) -> None:
        print(f"epbuild: {line}", file=sys.stderr)

    toolchains = Toolchains(create=True, say=say)
    return open_workspace(directory, manifest, selectors, toolchains=toolchains)


def _cache(ws: Workspace, directory: str | os.PathLike[str], option: str | None) -> ActionCache:
    base = os.path.abspath(directory)
    configured = ws.manifest.workspace.cache
    cache = open_cache(option, base=base, manifest_value=configured, manifest_root=ws.root)
    if cache is None:
        raise UserError(
            "the cache is off (EPBUILD_CACHE or [workspace] cache)", hint="pass --cache DIR"
        )
    return cache


def _keys(ws: Workspace) -> dict[str, tuple[str, dict[str, object]]]:
    """Action id → (key, components); raises the first broken input's error."""
    keys = {}
    for action in ws.actions:
        key = ws.keys.compute(action)
        keys[action.id] = (key.key, key.components)
    _save_stats(ws)
    return keys


def _save_stats(ws: Workspace) -> None:
    from epbuild.state import locks

    if ws.stats.dirty and os.path.isdir(ws.state_dir):
        with locks.hold(ws.state_lock, "epbuild cache (saving the stat cache)"):
            ws.stats.save()


def cache_key(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
) -> str:
    """A short stable string that changes exactly when some selected action key changes."""
    ws = _open(directory, manifest, selectors)
    keys = sorted({k for k, _ in _keys(ws).values()})
    return "epbuild-" + hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]


def export_cache(
    file: str | os.PathLike[str],
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    cache: str | None = None,
) -> tuple[ArchiveReport, list[str]]:
    """Write the entries the manifest needs to one archive; returns it and the missing ids."""
    from epbuild.cache.actioncache import CacheDamagedError

    ws = _open(directory, manifest, selectors)
    c = _cache(ws, directory, cache)
    entries, missing = [], []
    for action_id, (key, components) in _keys(ws).items():
        try:
            entry = c.local.get_entry(key)
            if entry is None and c.remote is not None:
                entry = c._pull(key)
        except (CacheDamagedError, OSError, ValueError) as exc:
            missing.append(f"{action_id}: {exc}")
            continue
        if entry is None:
            missing.append(f"{action_id}: {c.explain_miss(action_id, components)}")
        elif entry not in entries:
            entries.append(entry)
    report = export_entries(c.local, c.local_backend, entries, os.fspath(file))
    return report, missing


def import_cache(
    file: str | os.PathLike[str],
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> ArchiveReport:
    """Add an archive's entries to the local cache."""
    ws = _open(directory, manifest)
    c = _cache(ws, directory, cache)
    return import_archive(c.local, c.local_backend, os.fspath(file))


def prune_cache(
    max_size: int,
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> PruneReport:
    """Evict least-recently-used entries of the local cache down to ``max_size`` bytes."""
    ws = _open(directory, manifest)
    c = _cache(ws, directory, cache)
    return prune(c.local, max_size)


def verify_cache(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> CacheVerifyReport:
    """Re-hash every object of the local cache; discard damaged entries."""
    ws = _open(directory, manifest)
    c = _cache(ws, directory, cache)
    return verify_all(c.local, c.local_backend)


def _print_key(args: argparse.Namespace) -> int:
    key = cache_key(args.directory, args.manifest, args.selectors)
    if args.json:
        print_json({"key": key}, command="cache key")
    else:
        print(key)
    return 0


def _print_export(args: argparse.Namespace) -> int:
    report, missing = export_cache(
        args.file, args.directory, args.manifest, args.selectors, cache=args.cache
    )
    if args.json:
        doc = {"path": args.file, **asdict(report), "missing": list(missing)}
        print_json(doc, command="cache export", ok=not missing)
        return 1 if missing else 0
    print(
        f"epbuild: wrote {args.file}: {report.entries} entr(ies), {report.objects} object(s), "
        f"{report.bytes} bytes"
    )
    for line in missing:
        print(f"epbuild: missing {line}", file=sys.stderr)
    return 1 if missing else 0


def _print_import(args: argparse.Namespace) -> int:
    report = import_cache(args.file, args.directory, args.manifest, cache=args.cache)
    if args.json:
        doc = {k: v for k, v in asdict(report).items() if k != "problems"}
        doc = {"path": args.file, **doc, "warnings": list(report.problems)}
        print_json(doc, command="cache import", ok=not report.problems)
        return 1 if report.problems else 0
    print(
        f"epbuild: imported {report.entries} entr(ies), {report.objects} object(s), "
        f"{report.bytes} bytes from {args.file}"
    )
    for line in report.problems:
        print(f"epbuild: warning: {line}", file=sys.stderr)
    return 1 if report.problems else 0


def _print_verify(args: argparse.Namespace) -> int:
    checked = verify_cache(args.directory, args.manifest, cache=args.cache)
    if args.json:
        doc = {k: v for k, v in asdict(checked).items() if k != "problems"}
        doc["discarded"] = list(checked.problems)
        print_json(doc, command="cache verify", ok=not checked.problems)
        return 1 if checked.problems else 0
    print(
        f"epbuild: checked {checked.objects} object(s), {checked.bytes} bytes, of "
        f"{checked.entries} entr(ies); {len(checked.problems)} discarded"
    )
    for line in checked.problems:
        print(f"epbuild: {line}", file=sys.stderr)
    return 1 if checked.problems else 0


def _print_prune(args: argparse.Namespace) -> int:
    from epbuild.frontends.args import size_option

    limit = size_option(args.max_size, "--max-size", "10G or 500M")
    pruned = prune_cache(limit, args.directory, args.manifest, cache=args.cache)
    if args.json:
        print_json(asdict(pruned), command="cache prune")
        return 0
    print(
        f"epbuild: removed {pruned.entries_removed} entr(ies) ({pruned.bytes_removed} bytes), "
        f"kept {pruned.entries_kept} ({pruned.bytes_kept} bytes)"
    )
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
