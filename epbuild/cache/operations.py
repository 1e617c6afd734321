"""The cache operations behind ``epbuild cache``: a key for CI caches, export to and import
from one archive, prune to a size, verify every object. Library calls (``epbuild`` exports
them); ``frontends/cache_cli.py`` renders their results. Keys need the providers'
toolchain versions, so a missing toolchain is made, as ``build`` would (``say`` gets its
progress lines)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from epbuild.cache.actioncache import CacheDamagedError
from epbuild.cache.archive import ArchiveReport, export_entries, import_archive
from epbuild.cache.audit import CacheVerifyReport, verify_all
from epbuild.cache.layout import entry_path
from epbuild.cache.prune import PruneReport, prune
from epbuild.errors import ModelError, UserError
from epbuild.fs import os_error_text
from epbuild.kinds.check import CHECK, check_action
from epbuild.kinds.contract import kind_of
from epbuild.planning.workspace import open_action_cache, open_workspace, save_stats
from epbuild.toolchains.resolve import Toolchains


@dataclass
class ExportReport(ArchiveReport):
    """What ``export_cache`` wrote, and ``missing``: each selected action it could not
    (``ID: why``), which makes ``epbuild cache export`` exit 1."""

    missing: list[str] = field(default_factory=list)


if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.kinds.contract import GraphAction
    from epbuild.planning.staleness import ActionPlan
    from epbuild.planning.workspace import Workspace

__all__ = [
    "ArchiveReport",
    "CacheVerifyReport",
    "ExportReport",
    "PruneReport",
    "cache_key",
    "export_cache",
    "import_cache",
    "prune_cache",
    "store_up_to_date",
    "verify_cache",
]


def _open(
    directory: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | None,
    selectors: list[str] | tuple[str, ...] = (),
    say: Callable[[str], None] | None = None,
) -> Workspace:
    # Keys need the providers' toolchain versions: make a missing toolchain, as build would
    # (`cache key` on a fresh CI runner runs before any build).
    toolchains = Toolchains(create=True, say=say or (lambda _: None))
    return open_workspace(directory, manifest, selectors, toolchains=toolchains)


def _named_cache(
    directory: str | os.PathLike[str], manifest: str | os.PathLike[str] | None, option: str | None
) -> ActionCache:
    """The cache a command names (``option``) or the manifest configures; the workspace is
    only read for that: nothing is made, keyed or prepared."""
    return _cache(open_workspace(directory, manifest), directory, option)


def _cache(ws: Workspace, directory: str | os.PathLike[str], option: str | None) -> ActionCache:
    cache = open_action_cache(ws, directory, option)
    if cache is None:
        raise UserError(
            "the cache is off (EPBUILD_CACHE or [workspace] cache)", hint="pass --cache DIR"
        )
    return cache


def _keys(
    ws: Workspace, *, by_upstream: bool
) -> tuple[dict[str, tuple[str, dict[str, object]]], list[str]]:
    """Action id → (key, components) of every selected action, and why the keys of some
    cannot be known here; raises the first broken source input's error. An action that
    reads another's outputs is keyed by their bytes; where they are not on this machine
    (nothing built or restored yet), ``by_upstream`` keys it by the upstream action's key
    instead (the outputs follow from it), else it is listed as unknown."""
    keys: dict[str, tuple[str, dict[str, object]]] = {}
    unknown: list[str] = []
    by_id = {a.id: a for a in ws.graph}
    for action in ws.graph:
        if by_upstream:
            _stand_ins(ws, [by_id[dep] for dep in action.deps], keys)
        try:
            key = kind_of(action).key(action, ws.keys, fresh=False)
        except ModelError as exc:
            if not action.deps:
                raise
            unknown.append(
                f"{action.id}: its key is not known here ({exc.message}): it reads the "
                f"outputs of {', '.join(action.deps)}; build or restore those first"
            )
            continue
        finally:
            ws.keys.upstream.clear()
        keys[action.id] = (key.key, key.components)

    save_stats(ws)
    return keys, unknown


def _stand_ins(
    ws: Workspace, deps: list[GraphAction], keys: dict[str, tuple[str, dict[str, object]]]
) -> None:
    """Key the outputs of ``deps`` by their actions' keys: one folder's by the digest of the
    keys of every dependency writing there (a quantized group's QDQ models share one)."""
    import hashlib

    folders: dict[str, list[str]] = {}
    for dep in deps:
        folders.setdefault(dep.out_dir, []).append(keys[dep.id][0])
    for out_dir, found in folders.items():
        joined = ",".join(sorted(found))
        ws.keys.upstream[out_dir] = (
            found[0] if len(found) == 1 else hashlib.sha256(joined.encode()).hexdigest()
        )


def cache_key(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    say: Callable[[str], None] | None = None,
) -> str:
    """A short stable string that changes exactly when some selected action key changes."""
    ws = _open(directory, manifest, selectors, say)
    keys = sorted({k for k, _ in _keys(ws, by_upstream=True)[0].values()})
    return "epbuild-" + hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]


def export_cache(
    file: str | os.PathLike[str],
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    cache: str | None = None,
    say: Callable[[str], None] | None = None,
) -> ExportReport:
    """Write the entries the manifest needs to one archive; the report names the selected
    actions it could not write (``missing``: not cached, or damaged, and why)."""
    ws = _open(directory, manifest, selectors, say)
    c = _cache(ws, directory, cache)
    keyed, missing = _keys(ws, by_upstream=False)
    checks = _recorded_checks(ws)
    keyed.update(checks)
    entries = []
    for action_id, (key, components) in keyed.items():
        try:
            entry = c.local.get_entry(key)
            if entry is None and c.remote is not None:
                entry = c._pull(key)
        except (CacheDamagedError, OSError, ValueError) as exc:
            missing.append(f"{action_id}: {exc}")
            continue
        if entry is None:
            if action_id not in checks:  # a check is exported where it is cached, or not
                missing.append(f"{action_id}: {c.explain_miss(action_id, components)}")
        elif entry not in entries:
            entries.append(entry)
    report = export_entries(c.local, c.local_backend, entries, os.fspath(file))
    return ExportReport(**asdict(report), missing=missing + report.problems)


def _recorded_checks(ws: Workspace) -> dict[str, tuple[str, dict[str, object]]]:
    """Id → (key, components) of the numerical checks this workspace ran on the selected
    compiles, as they are now (a check joins a graph only when asked for: exported when it
    ran, never listed as missing)."""
    found: dict[str, tuple[str, dict[str, object]]] = {}
    for action in ws.actions:
        check = check_action(action, ws.manifest.workspace.state_dir)
        if check.id in ws.state.records:
            try:
                key = CHECK.key(check, ws.keys, fresh=False)
            except UserError:
                continue  # its inputs changed since: nothing current to export
            found[check.id] = (key.key, key.components)
    return found


def import_cache(
    file: str | os.PathLike[str],
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> ArchiveReport:
    """Add an archive's entries to the local cache."""
    c = _named_cache(directory, manifest, cache)
    return import_archive(c.local, c.local_backend, os.fspath(file))


def prune_cache(
    max_size: int,
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> PruneReport:
    """Evict least-recently-used entries of the local cache down to ``max_size`` bytes."""
    return prune(_named_cache(directory, manifest, cache).local, max_size)


def verify_cache(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    *,
    cache: str | None = None,
) -> CacheVerifyReport:
    """Re-hash every object of the local cache; discard damaged entries."""
    c = _named_cache(directory, manifest, cache)
    return verify_all(c.local, c.local_backend)


def store_up_to_date(
    ws: Workspace, plans: list[ActionPlan], directory: str | os.PathLike[str], cache: str
) -> list[str]:
    """Put each up-to-date action of ``plans`` that the local tier of ``cache`` (a
    directory or URL the caller named: ``build --cache DIR``) lacks into it, from its
    committed outputs: a new cache is seeded without a clean build. Returns warnings (a
    cache that cannot be written never fails the build)."""
    c = open_action_cache(ws, directory, cache)
    if c is None:
        return []
    warnings: list[str] = []
    for plan in plans:
        record = ws.state.records.get(plan.action.id)
        if plan.stale or record is None or c.local.backend.exists(entry_path(record.key)):
            continue
        try:  # the objects are hashed as they are copied: a changed output is refused
            warnings += c.save(record, os.path.join(ws.root, plan.action.out_dir))
        except Exception as exc:
            why = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
            warnings.append(f"{plan.action.id} not stored in the cache {c.describe()}: {why}")
    return warnings
