"""The ``epbuild cache`` commands as library calls: key, export, import, prune."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from epbuild.cache.archive import ArchiveReport, export_entries, import_archive
from epbuild.cache.location import open_cache
from epbuild.cache.prune import PruneReport, prune
from epbuild.cache.trust import CacheVerifyReport, verify_all
from epbuild.errors import UserError

if TYPE_CHECKING:
    from epbuild.cache.actioncache import ActionCache
    from epbuild.state.workspace import Workspace


def _open(directory: str | os.PathLike[str], manifest: str | os.PathLike[str] | None,
          selectors: list[str] | tuple[str, ...] = ()) -> Workspace:  # fmt: skip
    from epbuild.state.workspace import open_workspace

    return open_workspace(directory, manifest, selectors)


def _cache(ws: Workspace, directory: str | os.PathLike[str], option: str | None) -> ActionCache:
    cache = open_cache(
        option, base=os.path.abspath(directory), manifest_value=ws.manifest.workspace.cache,
        manifest_root=ws.root,
    )  # fmt: skip
    if cache is None:
        raise UserError("the cache is off (EPBUILD_CACHE or [workspace] cache)",
                        hint="pass --cache DIR")  # fmt: skip
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
