"""Least-recently-used eviction down to a size limit.

An entry's file time is its last use (written when stored, touched on every restore).
Entries are kept newest first while the unique bytes of their objects fit; the others are
removed with the objects only they used, but for an object a concurrent build marked used
since the prune started (it stores an entry naming it). Unreferenced objects and temp files
younger than a grace period are left alone: a concurrent build may be storing them before
writing its entry.
A symbolic link planted in the cache is never followed: prune removes the link itself (never
what it points at) and names it in a warning.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from epbuild.cache.backend import Backend
from epbuild.cache.layout import (
    ENTRIES,
    IDS,
    LOCKS,
    OBJECTS,
    VERIFIED,
    entry_path,
    object_path,
)
from epbuild.cache.local import LocalBackend
from epbuild.cache.store import CorruptEntryError, Store, is_key
from epbuild.state import locks

GRACE_SECONDS = 600.0


@dataclass(frozen=True)
class PruneReport:
    """What a prune removed and kept."""

    entries_removed: int
    entries_kept: int
    bytes_removed: int
    bytes_kept: int
    warnings: list[str] = field(default_factory=list)
    """One line per symbolic link found planted in the cache (removed, not followed)."""


def prune(store: Store, max_size: int, *, grace: float = GRACE_SECONDS) -> PruneReport:
    """Evict least-recently-used entries until the objects fit in ``max_size`` bytes."""
    backend = store.backend
    lock_dir = backend.root if isinstance(backend, LocalBackend) else None
    if lock_dir is None:
        return _prune(store, max_size, grace)
    with locks.hold(os.path.join(lock_dir, "prune.lock"), "epbuild cache prune", within=lock_dir):
        report = _prune(store, max_size, grace)
    assert isinstance(backend, LocalBackend)
    return PruneReport(
        report.entries_removed,
        report.entries_kept,
        report.bytes_removed,
        report.bytes_kept,
        backend.remove_links(),
    )


def _prune(store: Store, max_size: int, grace: float) -> PruneReport:
    backend = store.backend
    now = time.time()
    sizes = {f.path.rsplit("/", 1)[-1]: f for f in backend.walk(OBJECTS)}
    listed = sorted(backend.walk(ENTRIES), key=lambda f: f.mtime, reverse=True)
    kept_digests: set[str] = set()
    evicted: set[str] = set()
    total = kept = removed = 0
    for f in listed:
        key = f.path.rsplit("/", 1)[-1].removesuffix(".json")
        if not is_key(key):
            continue
        try:
            entry = store.get_entry(key)
        except CorruptEntryError:
            entry = None
        if entry is None:
            backend.delete(entry_path(key))
            removed += 1
            continue
        new = {o.digest for o in entry.outputs.values()} - kept_digests
        add = sum(sizes[d].size for d in new if d in sizes)
        if total + add <= max_size:
            kept_digests |= new
            total += add
            kept += 1
        else:
            store.discard(entry)
            evicted |= new
            removed += 1
    freed = 0
    for name, f in sizes.items():
        if name in kept_digests or not (name in evicted or now - max(f.mtime, f.atime) > grace):
            continue
        if _used_since(backend, f.path, now):
            continue  # a build stored an entry using it after the listing (``mark_used``)
        backend.delete(f.path)
        freed += f.size
    if isinstance(backend, LocalBackend):  # verified-stat records of objects that are gone
        for f in backend.walk(VERIFIED):
            if not backend.exists(object_path(f.path.rsplit("/", 1)[-1])):
                backend.delete(f.path)
    for f in backend.walk(IDS):  # markers of entries that are gone
        key = f.path.rsplit("/", 1)[-1]
        if not backend.exists(entry_path(key)) and now - f.mtime > grace:
            backend.delete(f.path)
    if isinstance(backend, LocalBackend):
        _prune_key_locks(backend, now - grace)
    return PruneReport(removed, kept, freed, total)


def _used_since(backend: Backend, path: str, since: float) -> bool:
    """Whether a local object was marked used (``LocalBackend.mark_used``: a store found it
    there and is about to write an entry naming it) at ``since`` or later."""
    if not isinstance(backend, LocalBackend):
        return False
    try:
        return os.lstat(backend.full(path)).st_atime >= since
    except OSError:
        return False


def _prune_key_locks(backend: LocalBackend, before: float) -> None:
    """Remove the key locks (``actioncache.key_lock``) of keys without an entry, last taken
    before ``before`` and free now. A build that opened one just before it goes can at worst
    compile a key a second time: a lock file is never a correctness matter for the cache."""
    for f in backend.walk(LOCKS):
        name = f.path.rsplit("/", 1)[-1]
        key = name.removesuffix(".lock")
        if not name.endswith(".lock") or not is_key(key) or backend.exists(entry_path(key)):
            continue
        full = backend.full(f.path)
        try:
            if os.lstat(full + ".owner").st_mtime > before:
                continue
        except OSError:
            if f.mtime > before:
                continue
        # No owner note: the lock goes at once, and a link planted there is never written.
        with locks.try_hold(full, "epbuild cache prune", note=False, within=backend.root) as held:
            if held is None:
                continue  # a build holds it
            backend.delete(f.path + ".owner")
            backend.delete(f.path)
