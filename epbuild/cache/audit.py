"""``epbuild cache verify``: re-hash every object every entry of a directory cache uses,
whatever ``trust`` recorded; discard damaged entries and re-record intact objects' stats. A
symbolic link planted in the cache is damage too: never followed, removed (the link itself,
never what it points at) and listed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from epbuild.cache import trust
from epbuild.cache.layout import entry_path, object_path
from epbuild.cache.local import LocalBackend
from epbuild.cache.store import CorruptEntryError, Store
from epbuild.fs import LinkedPathError
from epbuild.state.statcache import hash_file


@dataclass(frozen=True)
class CacheVerifyReport:
    """What ``verify_all`` checked and discarded."""

    entries: int
    objects: int
    bytes: int
    problems: list[str] = field(default_factory=list)
    """One line per discarded entry (which output was missing or damaged) and per link
    found planted in the cache (removed)."""


def verify_all(store: Store, backend: LocalBackend) -> CacheVerifyReport:
    """Re-hash every object every entry uses, ignoring recorded stats; discard damaged
    entries (and their damaged objects) and re-record the stats of intact objects. An
    entry removed while it was checked (a concurrent prune) is neither: it is gone."""
    for _ in backend.walk(""):  # first, every link planted anywhere in the cache is met
        pass
    intact: dict[str, bool] = {}
    problems: list[str] = []
    entries = objects = size = 0
    for key in store.entry_keys():
        try:
            entry = store.get_entry(key)
        except CorruptEntryError as exc:
            store.discard(key)
            problems.append(f"{exc}; discarded")
            continue
        if entry is None:
            continue
        entries += 1
        bad: list[str] = []
        for name, out in entry.outputs.items():
            if out.digest not in intact:
                try:
                    full = backend.file(object_path(out.digest))
                    st = os.stat(full)
                    ok = st.st_size == out.size and hash_file(full) == out.digest
                except (FileNotFoundError, LinkedPathError, PermissionError):
                    ok = False  # an object this user cannot read is damage too
                intact[out.digest] = ok
                if ok:
                    objects, size = objects + 1, size + out.size
                    if os.stat(full).st_mtime_ns == st.st_mtime_ns:
                        trust.record(backend.root, out.digest, st)
                else:
                    trust.forget(backend.root, out.digest)
            if not intact[out.digest]:
                bad.append(name)
        if bad and not backend.exists(entry_path(key)):
            entries -= 1  # removed meanwhile (a prune evicts an entry, then its objects)
            continue
        if bad:
            damaged = tuple(o.digest for n, o in entry.outputs.items() if n in bad)
            store.discard(entry, damaged=damaged)
            problems.append(
                f"entry {key[:12]} ({entry.id}): {', '.join(bad)} missing or damaged; discarded"
            )
    return CacheVerifyReport(entries, objects, size, problems + backend.remove_links())
