"""Content digests with a stat cache: an unchanged file is never read twice.

Entries map a workspace-relative path to (inode, size, mtime_ns, ctime_ns) → sha256
digest, plus, for ONNX models, the external-data files the model references (parsed once per
digest). The change time is what a rewrite that puts the old mtime back (``os.utime``,
``touch -r``, an archiver) cannot put back: a file hashed as an input is trusted only while
it is unchanged too (git's index and Bazel's digest cache hold the same). An output entry
that epbuild committed has none (``ctime_ns`` None): a restored output is a hard link to a
cache object, whose change time moves whenever another workspace links or uses it.
The file is rewritten whole (temp + rename) under the state lock, merging entries other
processes wrote meanwhile, so concurrent writers never corrupt it.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections import namedtuple

from epbuild.fs import atomic_write_bytes, digest_file, is_safe_reference, sha256_hex

_VERSION = 3  # 2: a sha256 of the payload on the first line; 3: the change time
_RACY_NS = 20_000_000  # an mtime this close to "now" may still change within its tick
# What a damaged or hand-edited stat cache can raise while it is read: it is then dropped.
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError)


class Entry(namedtuple("Entry", "ino size mtime_ns digest refs ctime_ns", defaults=(None, None))):
    """What we know about one file's content (a named tuple: a stat cache holds thousands,
    made at every load; made by ``collections``, as ``typing.NamedTuple`` compiles each
    annotation)."""

    __slots__ = ()
    ino: int
    size: int
    mtime_ns: int
    digest: str
    refs: tuple[str, ...] | None
    """External-data files (workspace-relative) of an ONNX model; None if not parsed."""
    ctime_ns: int | None
    """The change time it was hashed at (None: an output epbuild committed, see above)."""


def hash_file(path: str) -> str:
    """sha256 hex digest of a file's bytes (read in pieces)."""
    return digest_file(path).sha256


def _well_formed(rel: object, e: Entry) -> bool:
    ints = type(e.ino) is int and type(e.size) is int and type(e.mtime_ns) is int  # not bool
    return (
        ints
        and type(rel) is str
        and is_safe_reference(rel)
        and type(e.digest) is str
        and len(e.digest) == 64
        and (e.refs is None or all(type(r) is str and is_safe_reference(r) for r in e.refs))
        and (e.ctime_ns is None or type(e.ctime_ns) is int)
    )


_new = tuple.__new__


class StatCache:
    """Maps files to digests, re-hashing only when their stat changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}
        self.dirty: dict[str, Entry] = {}
        self.dropped: set[str] = set()
        """Entries to remove from the file at the next save (their file was found damaged)."""
        self.written_ns = 0
        """The mtime of the file when it was read: an entry at least as new is racy."""
        self.hashed = 0
        """How many files were read and hashed in this process (for tests and reports)."""
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                self.written_ns = os.fstat(f.fileno()).st_mtime_ns
                head, _, body = f.read().partition(b"\n")
            header = json.loads(head)
            if header.get("version") != _VERSION:
                return
            if header.get("sha256") != sha256_hex(body):
                return
            data = json.loads(body)
            if not isinstance(data, dict):
                return
            entries = self.entries
            for rel, e in data["entries"].items():
                refs = e[4]
                if refs is not None:
                    refs = tuple(refs)
                entry = _new(Entry, (e[0], e[1], e[2], e[3], refs, e[5]))
                if not _well_formed(rel, entry):
                    raise ValueError(rel)
                entries[rel] = entry
        except _UNREADABLE:
            self.entries = {}  # a damaged stat cache only costs re-hashing

    def lookup(self, rel: str, st: os.stat_result) -> Entry | None:
        """The cached entry for ``rel`` if its stat still matches.

        A saved entry whose mtime is not older than the stat cache's own write is *racy*
        (git's index rule): on a filesystem with coarse timestamps (1–2 s on FAT, HFS+, some
        NFS) a same-size rewrite in the same tick keeps (inode, size, mtime), so such an
        entry is re-hashed rather than trusted."""
        e = self.dirty.get(rel)
        if e is None:
            e = self.entries.get(rel)
            if e is not None and e.mtime_ns >= self.written_ns:
                return None
        if e is None or (e.ino, e.size, e.mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
            return None
        return e if e.ctime_ns is None or e.ctime_ns == st.st_ctime_ns else None

    def digest(self, root: str, rel: str, *, output: bool = False) -> Entry:
        """Entry for ``root/rel``: from the cache when the stat matches, else hashed now
        (``output``, an output epbuild committed: with no change time, see above).
        Anything but a regular file is an ``OSError`` (reading a FIFO would block, a device
        never end)."""
        full = os.path.join(root, rel)
        st = os.stat(full)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", full)
        cached = self.lookup(rel, st)
        if cached is not None:
            return cached
        digest = hash_file(full)
        self.hashed += 1
        after = os.stat(full)
        ctime = None if output else after.st_ctime_ns
        entry = Entry(after.st_ino, after.st_size, after.st_mtime_ns, digest, None, ctime)
        if (after.st_mtime_ns, after.st_size, after.st_ctime_ns) == (
            st.st_mtime_ns,
            st.st_size,
            st.st_ctime_ns,
        ):
            self.remember(rel, entry)
        return entry

    def remember(self, rel: str, entry: Entry) -> None:
        """Record an entry (unless its mtime is too recent to trust)."""
        if time.time_ns() - entry.mtime_ns < _RACY_NS:
            return
        self.dirty[rel] = entry

    def forget(self, rels: list[str] | tuple[str, ...]) -> None:
        """Stop trusting what is known of these files (a check found them damaged): the
        next lookup re-hashes them, in this process and, after ``save``, in every other."""
        for rel in rels:
            self.dirty.pop(rel, None)
            self.entries.pop(rel, None)
            self.dropped.add(rel)

    def with_refs(self, rel: str, entry: Entry, refs: tuple[str, ...]) -> Entry:
        """Attach parsed external-data references to an entry and remember it."""
        new = entry._replace(refs=refs)
        self.remember(rel, new)
        return new

    def save(self) -> None:
        """Merge our new entries into the file on disk (call under the state lock)."""
        if not self.dirty and not self.dropped:
            return
        current = StatCache.__new__(StatCache)
        current.path = self.path
        current.entries = {}
        current._load()
        current.entries.update(self.dirty)
        for rel in self.dropped:
            current.entries.pop(rel, None)
        payload = {
            "entries": {
                rel: [
                    e.ino,
                    e.size,
                    e.mtime_ns,
                    e.digest,
                    None if e.refs is None else list(e.refs),
                    e.ctime_ns,
                ]
                for rel, e in current.entries.items()
            },
        }
        body = json.dumps(payload, separators=(",", ":")).encode()
        head = {"version": _VERSION, "sha256": sha256_hex(body)}
        # Not synced: what a power cut leaves of it fails the sha256 and is dropped, which
        # only costs re-hashing (the files it vouches for are stat'ed against it anyway).
        atomic_write_bytes(self.path, json.dumps(head).encode() + b"\n" + body, durable=False)
        self.entries = current.entries
        self.dirty = {}
        self.dropped = set()
        try:
            self.written_ns = os.stat(self.path).st_mtime_ns
        except OSError:
            self.written_ns = time.time_ns()
