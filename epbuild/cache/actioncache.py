"""The action cache a build talks to: a local directory tier, optionally in front of a
remote (fsspec) tier that is read on a local miss and written with ``push``.

A remote tier that fails (``CacheUnavailableError``: unreachable, timed out, denied) is
switched off for the rest of the run and the reason kept in ``outage``: the build goes on
with the local tier, says so once, and only ``--cache-only`` fails for it.

A restore materializes every output into a directory (hard link, reflink or copy) and
verifies its size and digest — a hard-linked object whose stat is unchanged since it was last
verified is taken on trust (see ``trust``); a damaged or partial entry is discarded and
reported, never restored. A remote hit is first pulled into the local tier, verified on the
way in.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from epbuild._dataclass import dataclass, replace
from epbuild.cache import trust
from epbuild.cache.layout import entry_path, key_lock_path, object_path
from epbuild.cache.local import LocalBackend
from epbuild.cache.store import CachedOutput, CacheEntry, CorruptEntryError, Store
from epbuild.errors import CacheUnavailableError
from epbuild.fs import CHUNK, LinkedPathError, new_sha256
from epbuild.planning.keys import explain_difference
from epbuild.state.journal import ActionRecord
from epbuild.state.statcache import hash_file

T = TypeVar("T")


class CacheDamagedError(Exception):
    """A cache entry was found but could not be restored; it has been discarded."""


@dataclass(frozen=True)
class Restored:
    """A successful restore."""

    entry: CacheEntry
    source: str
    """The cache it came from (the local directory or the remote URL)."""
    method: str
    """How the files were put in place: link, reflink or copy (the weakest used)."""


class ActionCache:
    """Local tier + optional remote tier."""

    def __init__(
        self, local_dir: str, remote_url: str | None = None, *, push: bool = False
    ) -> None:
        self.local_backend = LocalBackend(local_dir)
        self.found = os.path.isdir(local_dir)
        """Whether the local directory was there when the cache was opened (a miss says so)."""
        self.local = Store(self.local_backend)
        self.remote: Store | None = None
        self.push = push
        self.outage: str | None = None
        """Why the remote tier was switched off in this run (None: it works, or there is none)."""
        self._outage_lock = threading.Lock()
        self.remote_url = remote_url
        if remote_url:
            from epbuild.cache.remote import FsspecBackend

            try:
                self.remote = Store(FsspecBackend(remote_url))
            except CacheUnavailableError as exc:
                self.outage = exc.message

    def _remote(self, call: Callable[[Store], T], default: T) -> T:
        """Ask the remote tier, unless it is off; a failure switches it off and gives
        ``default`` (the first failure's message stays in ``outage``)."""
        remote = self.remote
        if remote is None or self.outage is not None:
            return default
        try:
            return call(remote)
        except CacheUnavailableError as exc:
            with self._outage_lock:
                if self.outage is None:
                    self.outage = exc.message
            return default

    def key_lock(self, key: str) -> str:
        """The lock file a build holds while it restores or compiles ``key``, in the local
        tier: builds sharing the directory compile each key once (see ``prune``). Taken with
        ``within=self.local_backend.root``: never through a link planted in the cache."""
        return self.local_backend.full(key_lock_path(key))

    def describe(self) -> str:
        """Where the cache is, for messages."""
        return self.local.url + (f" + {self.remote_url}" if self.remote_url else "")

    # -- restore -------------------------------------------------------------------------

    def restore(self, key: str, dest_dir: str) -> Restored | None:
        """Put the outputs of ``key`` into ``dest_dir``; None on a miss.

        Raises CacheDamagedError (after discarding the entry) when an entry exists but is
        unreadable, misses an object or an object's digest is wrong.
        """
        source = self.local.url
        try:
            entry = self.local.get_entry(key)
        except CorruptEntryError as exc:
            self.local.discard(key)
            raise CacheDamagedError(f"{exc} in {self.local.url}; discarded") from exc
        if entry is None and self.remote is not None:
            entry = self._remote(lambda _: self._pull(key), None)
            source = self.remote.url
        if entry is None:
            return None
        methods = {
            self._place(entry, name, out, os.path.join(dest_dir, name))
            for name, out in entry.outputs.items()
        }
        self.local_backend.touch(entry_path(key))
        method = "copy" if "copy" in methods else "reflink" if "reflink" in methods else "link"
        return Restored(entry, source, method)

    def _place(self, entry: CacheEntry, name: str, out: CachedOutput, dest: str) -> str:
        """Put the object of output ``name`` at ``dest`` and check it (see ``restore``);
        says how (link, reflink, copy)."""
        key = entry.key
        try:
            method = self.local_backend.materialize(object_path(out.digest), dest)
        except FileNotFoundError:
            self.local.discard(entry)
            raise CacheDamagedError(
                f"entry {key[:12]} in {self.local.url}: the object of {name} is missing; discarded"
            ) from None
        except PermissionError:
            raise self._unreadable(entry, name, out.digest, dest) from None
        st = os.stat(dest)
        linked = method == "link"  # dest is the object itself: same inode, same bytes
        if (
            linked
            and st.st_size == out.size
            and trust.is_trusted(self.local_backend.root, out.digest, st)
            and os.access(dest, os.R_OK)  # (a mode change keeps the stat trusted)
        ):
            return method
        try:
            size, digest = st.st_size, hash_file(dest)
        except PermissionError:  # a hard link to an object this user cannot read
            raise self._unreadable(entry, name, out.digest, dest) from None
        if (size, digest) != (out.size, out.digest):
            os.unlink(dest)
            trust.forget(self.local_backend.root, out.digest)
            self.local.discard(entry, damaged=(out.digest,))
            raise CacheDamagedError(
                f"entry {key[:12]} in {self.local.url}: {name} is damaged (expected "
                f"{out.digest[:12]}, {out.size} bytes; found {digest[:12]}, {size} bytes); "
                "discarded"
            )
        after = os.stat(dest)
        if linked and (after.st_ino, after.st_size, after.st_mtime_ns) == (
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
        ):
            trust.record(self.local_backend.root, out.digest, st)
        return method

    def _unreadable(
        self, entry: CacheEntry, name: str, digest: str, dest: str
    ) -> CacheDamagedError:
        """An object this user cannot read (another user's, made unreadable): damage. The
        entry and the object are discarded, so that the next build stores them anew."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest)
        self.local.discard(entry, damaged=(digest,))
        return CacheDamagedError(
            f"entry {entry.key[:12]} in {self.local.url}: the object of {name} "
            f"({self.local_backend.full(object_path(digest))}) cannot be read; discarded"
        )

    def discard(self, key: str) -> None:
        """Drop the local entry of ``key``: what it restored failed the build's checks."""
        self.local.discard(key)

    def _pull(self, key: str) -> CacheEntry | None:
        assert self.remote is not None
        try:
            entry = self.remote.get_entry(key)
        except CorruptEntryError as exc:
            raise CacheDamagedError(f"{exc} in {self.remote.url}; not used") from exc
        if entry is None:
            return None
        for name, out in entry.outputs.items():
            if self.local.has_object(out.digest):
                continue
            with trust.sealed_object(self.local_backend.root, out.digest) as tmp:
                try:
                    self.remote.backend.download(object_path(out.digest), tmp, out.size)
                except FileNotFoundError:
                    raise CacheDamagedError(
                        f"entry {key[:12]} in {self.remote.url}: the object of {name} is "
                        "missing; not used"
                    ) from None
                if hash_file(tmp) != out.digest:
                    raise CacheDamagedError(
                        f"entry {key[:12]} in {self.remote.url}: {name} is damaged; not used"
                    )
        self.local.put_entry(entry)
        return entry

    # -- store ---------------------------------------------------------------------------

    def save(
        self,
        record: ActionRecord,
        src_dir: str,
        vouched: Callable[[str], tuple[int, int, int] | None] | None = None,
    ) -> list[str]:
        """Store an action's committed outputs (``record``: its journal record, outputs in
        ``src_dir``; objects first, entry last); push if asked. ``vouched``: output name →
        the stat at which the workspace's stat cache vouches for its digest, for outputs in
        the state directory, which become their objects by a hard link
        (``trust.adopted_object``); None (or no ``vouched``): copied and hashed on the way.
        Returns one line per link found planted in an object's place (replaced by it)."""
        entry = replace(record.named(), at=time.time(), restored=False)
        replaced = []
        for name, out in entry.outputs.items():
            stat_key = vouched(name) if vouched is not None else None
            link = self._ingest(os.path.join(src_dir, name), out, stat_key)
            if link is not None:
                replaced.append(
                    f"{link} was a symbolic link to {self.local_backend.links.get(link, '?')} "
                    "that epbuild did not make; not followed, and replaced by the object"
                )
        self.local.put_entry(entry)
        if self.push and self.remote is not None:
            self._remote(lambda _: self.push_entry(entry), None)
        return replaced

    def push_entry(self, entry: CacheEntry) -> None:
        """Copy a local entry and its objects to the remote tier."""
        assert self.remote is not None
        for out in entry.outputs.values():
            if not self.remote.has_object(out.digest):
                self.remote.backend.upload(
                    self.local_backend.file(object_path(out.digest)), object_path(out.digest)
                )
        self.remote.put_entry(entry)

    def _ingest(
        self, src: str, out: CachedOutput, vouched: tuple[int, int, int] | None
    ) -> str | None:
        """Make ``src`` the object ``out.digest`` unless it is there; returns the path of a
        link planted in the object's place, which the object replaces (None: there was none)."""
        path = object_path(out.digest)
        link = None
        try:
            full = self.local_backend.file(path)
            present = os.path.getsize(full) == out.size and os.access(full, os.R_OK)
        except FileNotFoundError:
            present = False
        except LinkedPathError as exc:  # at the object itself it is replaced (by a rename)
            link, present = os.fsdecode(exc.filename), False
        if present:
            self.local_backend.mark_used(path)  # keeps it out of a concurrent prune's reach
            return None
        root = self.local_backend.root
        if vouched is not None and trust.adopted_object(root, out.digest, src, vouched):
            return link
        h = new_sha256(out.size)
        with trust.sealed_object(root, out.digest) as tmp:
            with open(src, "rb") as s, open(tmp, "wb") as d:
                while chunk := s.read(CHUNK):
                    h.update(chunk)
                    d.write(chunk)
            if h.hexdigest() != out.digest:
                raise OSError(f"{os.path.basename(src)} changed while it was being cached")
        return link

    # -- explain -------------------------------------------------------------------------

    def has(self, key: str) -> str | None:
        """Which tier holds an entry for ``key`` (not verified), or None."""
        if self.local.backend.exists(entry_path(key)):
            return self.local.url
        return self._remote(lambda r: r.url if r.backend.exists(entry_path(key)) else None, None)

    def entry(self, key: str) -> CacheEntry | None:
        """The entry for ``key`` (its objects not verified) from the tier that holds it,
        or None; raises ``CorruptEntryError`` for an unreadable one."""
        found = self.local.get_entry(key)
        if found is None:
            found = self._remote(lambda r: r.get_entry(key), None)
        return found

    def lacking(self, entry: CacheEntry) -> str | None:
        """The first output of a local ``entry`` whose object is not there whole (missing,
        another size, a link planted in its place; not hashed: a restore does that), or
        None."""
        for name, out in entry.outputs.items():
            try:
                if os.path.getsize(self.local_backend.file(object_path(out.digest))) == out.size:
                    continue
            except OSError:
                pass
            return name
        return None

    def local_copy(self, digest: str) -> str | None:
        """The local tier's file of an object (not verified), or None where it has none."""
        path = object_path(digest)
        return self.local_backend.full(path) if self.local.has_object(digest) else None

    def explain_miss(self, action_id: str, components: dict[str, Any]) -> str:
        """Why ``components`` have no entry: what differs from this action's nearest entry."""
        entries = self.local.entries_for(action_id)
        entries += self._remote(lambda r: r.entries_for(action_id), [])
        if self.outage is not None:
            why = f"the remote cache is unavailable ({self.outage})"
            if not entries:
                return why
            why += "; locally"
        elif not entries:
            where = self.describe()
            if not self.found and self.remote is None:
                where += ", a directory that did not exist"
            return f"no entry for {action_id} in the cache ({where})"
        # The nearest entry: fewest differences (another machine's build of the same
        # action, say), the newest among equals.
        diff = min(
            (explain_difference(e.components, components) for e in entries_by_age(entries)),
            key=len,
        )
        text = f"the cache has {action_id} under another key (cache → here): " + "; ".join(diff)
        return text if self.outage is None else f"{why}, {text}"


def entries_by_age(entries: list[Any]) -> list[Any]:
    """Cache entries, the newest first."""
    return sorted(entries, key=lambda e: e.at, reverse=True)
