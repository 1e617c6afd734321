"""Objects by digest and entries by action key, over one backend.

Layout: ``layout`` (``v1/`` so a future format can live beside this one).

Writers put every object first and the entry last, each by an atomic write, so a reader
that finds an entry finds its objects — unless something removed them since, which a
restore detects by verifying every digest.
"""

from __future__ import annotations

import json
import re
import time

from epbuild._dataclass import replace
from epbuild.cache.backend import Backend
from epbuild.cache.layout import ENTRIES, IDS, entry_path, object_path
from epbuild.cache.layout import LAYOUT as LAYOUT  # (the store's names, as they were)
from epbuild.cache.layout import LOCKS as LOCKS
from epbuild.cache.layout import OBJECTS as OBJECTS
from epbuild.fs import sha256_hex
from epbuild.state.journal import ActionRecord, OutputRecord

CachedOutput = OutputRecord
"""One output file of an entry: the same record the state keeps."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]*")


class CorruptEntryError(Exception):
    """An entry that cannot be used (unreadable, or an object is missing or damaged)."""


CacheEntry = ActionRecord
"""What one action key produced: the record of the run that stored it (the journal's record
type), its outputs named by file inside the action's output directory; ``at`` is when it
was stored."""


def entry_bytes(entry: CacheEntry) -> bytes:
    """The stored JSON form of an entry: the record's (``ActionRecord.to_json``), marked,
    with ``created`` kept for readers of the earlier form."""
    data = {"epbuild_cache_entry": 1, **entry.to_json(), "created": entry.at or time.time()}
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def parse_entry(raw: bytes, key: str) -> CacheEntry:
    """Parse and validate a stored entry (raises CorruptEntryError)."""
    try:
        data = json.loads(raw)
        if data.get("epbuild_cache_entry") != 1 or data["key"] != key:
            raise ValueError("not an entry for this key")
        data.setdefault("at", data.get("created", 0.0))
        entry = ActionRecord.from_json(data)
        for name, o in entry.outputs.items():
            if not _NAME.fullmatch(name) or not _HEX64.fullmatch(o.digest):
                raise ValueError(f"bad output record {name!r}")
        if not entry.outputs:
            raise ValueError("no outputs")
        return replace(entry, restored=False)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptEntryError(f"entry {key[:12]} is unreadable ({exc})") from exc


def id_dir(action_id: str) -> str:
    """Where the markers of one action id's entries live."""
    return f"{IDS}/{sha256_hex(action_id.encode())[:24]}"


def is_key(text: str) -> bool:
    """Whether ``text`` looks like an action key or digest."""
    return bool(_HEX64.fullmatch(text))


class Store:
    """Entries and objects in one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def url(self) -> str:
        """Where the store is, for messages."""
        return self.backend.url

    def get_entry(self, key: str) -> CacheEntry | None:
        """The entry for ``key``; None when absent (raises CorruptEntryError)."""
        raw = self.backend.read_bytes(entry_path(key))
        return None if raw is None else parse_entry(raw, key)

    def has_object(self, digest: str) -> bool:
        """Whether an object is present (not whether it is intact)."""
        return self.backend.exists(object_path(digest))

    def put_entry(self, entry: CacheEntry) -> None:
        """Write an entry (after its objects) and its id marker."""
        self.backend.write_bytes(entry_path(entry.key), entry_bytes(entry))
        self.backend.write_bytes(f"{id_dir(entry.id)}/{entry.key}", b"")

    def discard(self, entry: CacheEntry | str, damaged: tuple[str, ...] = ()) -> None:
        """Remove an entry (and objects known to be damaged)."""
        key = entry if isinstance(entry, str) else entry.key
        for digest in damaged:
            self.backend.delete(object_path(digest))
        self.backend.delete(entry_path(key))
        if not isinstance(entry, str):
            self.backend.delete(f"{id_dir(entry.id)}/{key}")

    def entries_for(self, action_id: str) -> list[CacheEntry]:
        """Readable entries of one action id, newest first."""
        found: list[CacheEntry] = []
        for key in self.backend.listdir(id_dir(action_id)):
            if not is_key(key):
                continue
            try:
                entry = self.get_entry(key)
            except CorruptEntryError:
                continue
            if entry is not None and entry.id == action_id:
                found.append(entry)
        return sorted(found, key=lambda e: e.at, reverse=True)

    def entry_keys(self) -> list[str]:
        """Every entry key in the store."""
        keys: list[str] = []
        for sub in self.backend.listdir(ENTRIES):
            for name in self.backend.listdir(f"{ENTRIES}/{sub}"):
                if name.endswith(".json") and is_key(name[:-5]):
                    keys.append(name[:-5])
        return keys
