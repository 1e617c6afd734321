"""Objects by digest and entries by action key, over one backend.

Layout (``v1/`` so a future format can live beside this one)::

    v1/objects/ab/abcdef…            output bytes, named by their sha256
    v1/entries/12/1234…json          one action key → output names, sizes, digests, components
    v1/ids/<hash of action id>/<key> marker: entries of one action id (to explain a miss)
    v1/locks/12/1234….lock           held by the build restoring or compiling that key

Writers put every object first and the entry last, each by an atomic write, so a reader
that finds an entry finds its objects — unless something removed them since, which a
restore detects by verifying every digest.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from epbuild._names import CACHE_LAYOUT
from epbuild.cache.backend import Backend
from epbuild.state.journal import OutputRecord

CachedOutput = OutputRecord
"""One output file of an entry: the same record the state keeps."""

LAYOUT = CACHE_LAYOUT
OBJECTS = f"{LAYOUT}/objects"
ENTRIES = f"{LAYOUT}/entries"
IDS = f"{LAYOUT}/ids"
LOCKS = f"{LAYOUT}/locks"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+\-]*")


class CorruptEntryError(Exception):
    """An entry that cannot be used (unreadable, or an object is missing or damaged)."""


@dataclass(frozen=True)
class CacheEntry:
    """What one action key produced."""

    key: str
    action_id: str
    components: dict[str, Any]
    outputs: dict[str, CachedOutput]
    """Output file name (inside the action's output directory) → size and digest."""
    seconds: float = 0.0
    peak_rss: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    @property
    def size(self) -> int:
        """Bytes of all outputs."""
        return sum(o.size for o in self.outputs.values())

    def to_bytes(self) -> bytes:
        """The stored JSON form."""
        data = {
            "epbuild_cache_entry": 1,
            "key": self.key,
            "id": self.action_id,
            "components": self.components,
            "outputs": {n: {"size": o.size, "digest": o.digest} for n, o in self.outputs.items()},
            "seconds": round(self.seconds, 4),
            "peak_rss": self.peak_rss,
            "detail": self.detail,
            "created": self.created or time.time(),
        }
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, key: str) -> CacheEntry:
        """Parse and validate a stored entry (raises CorruptEntryError)."""
        try:
            data = json.loads(raw)
            if data.get("epbuild_cache_entry") != 1 or data["key"] != key:
                raise ValueError("not an entry for this key")
            outputs = {
                str(name): CachedOutput(int(o["size"]), str(o["digest"]))
                for name, o in data["outputs"].items()
            }
            for name, o in outputs.items():
                if not _NAME.fullmatch(name) or not _HEX64.fullmatch(o.digest) or o.size < 0:
                    raise ValueError(f"bad output record {name!r}")
            if not isinstance(data["components"], dict) or not outputs:
                raise ValueError("no components or outputs")
            return cls(
                key=key,
                action_id=str(data["id"]),
                components=data["components"],
                outputs=outputs,
                seconds=float(data.get("seconds", 0.0)),
                peak_rss=int(data.get("peak_rss", 0)),
                detail=dict(data.get("detail", {})),
                created=float(data.get("created", 0.0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptEntryError(f"entry {key[:12]} is unreadable ({exc})") from exc


def object_path(digest: str) -> str:
    """Where an object lives."""
    return f"{OBJECTS}/{digest[:2]}/{digest}"


def entry_path(key: str) -> str:
    """Where an entry lives."""
    return f"{ENTRIES}/{key[:2]}/{key}.json"


def id_dir(action_id: str) -> str:
    """Where the markers of one action id's entries live."""
    return f"{IDS}/{hashlib.sha256(action_id.encode()).hexdigest()[:24]}"


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
        return None if raw is None else CacheEntry.from_bytes(raw, key)

    def has_object(self, digest: str) -> bool:
        """Whether an object is present (not whether it is intact)."""
        return self.backend.exists(object_path(digest))

    def put_entry(self, entry: CacheEntry) -> None:
        """Write an entry (after its objects) and its id marker."""
        self.backend.write_bytes(entry_path(entry.key), entry.to_bytes())
        self.backend.write_bytes(f"{id_dir(entry.action_id)}/{entry.key}", b"")

    def discard(self, entry: CacheEntry | str, damaged: tuple[str, ...] = ()) -> None:
        """Remove an entry (and objects known to be damaged)."""
        key = entry if isinstance(entry, str) else entry.key
        for digest in damaged:
            self.backend.delete(object_path(digest))
        self.backend.delete(entry_path(key))
        if not isinstance(entry, str):
            self.backend.delete(f"{id_dir(entry.action_id)}/{key}")

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
            if entry is not None and entry.action_id == action_id:
                found.append(entry)
        return sorted(found, key=lambda e: e.created, reverse=True)

    def entry_keys(self) -> list[str]:
        """Every entry key in the store."""
        keys: list[str] = []
        for sub in self.backend.listdir(ENTRIES):
            for name in self.backend.listdir(f"{ENTRIES}/{sub}"):
                if name.endswith(".json") and is_key(name[:-5]):
                    keys.append(name[:-5])
        return keys
