"""Single-file cache archives (for CI systems that cache files, not directories).

A tar (gzip-compressed when the name ends in ``.gz``/``.tgz``) in the store's own layout:
objects first, entries after them. Import streams members, accepts only object and entry
paths, verifies every object's digest on the way in and writes an entry only when all its
objects are present, so a truncated or tampered archive never yields a usable bad entry.
A cache that cannot be written (read-only, full) stops the import with a ``StorageError``
naming the cache: the archive is not to blame.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from dataclasses import dataclass, field
from typing import IO

from epbuild.cache import trust
from epbuild.cache.layout import ENTRIES, OBJECTS, entry_path, object_path
from epbuild.cache.local import LocalBackend
from epbuild.cache.store import CacheEntry, CorruptEntryError, Store, entry_bytes, parse_entry
from epbuild.errors import StorageError, UnsafePathError, UserError
from epbuild.fs import CHUNK, atomic_output, digest_file, inside, os_error_text

_OBJECT = re.compile(rf"{OBJECTS}/[0-9a-f]{{2}}/([0-9a-f]{{64}})")
_ENTRY = re.compile(rf"{ENTRIES}/[0-9a-f]{{2}}/([0-9a-f]{{64}})\.json")


@dataclass
class ArchiveReport:
    """What an export or import moved."""

    entries: int = 0
    objects: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)


def export_entries(
    store: Store, backend: LocalBackend, entries: list[CacheEntry], path: str
) -> ArchiveReport:
    """Write ``entries`` and their objects (each verified) to an archive at ``path``. An
    entry whose object was removed meanwhile (a concurrent prune) is left out and named in
    the report's ``problems`` (``ID: why``)."""
    _refuse_destination(path, backend.root)
    report = ArchiveReport()
    gone: set[str] = set()
    with atomic_output(os.path.abspath(path), durable=False, leftovers=True) as tmp:
        gz = path.endswith((".gz", ".tgz"))
        with tarfile.open(tmp, "w:gz") if gz else tarfile.open(tmp, "w") as tar:
            digests = sorted({o.digest for e in entries for o in e.outputs.values()})
            for digest in digests:
                try:
                    full = backend.file(object_path(digest))  # never through a planted link
                    found = digest_file(full).sha256
                    info = tar.gettarinfo(full, arcname=object_path(digest))
                    f = open(full, "rb")  # noqa: SIM115 (closed below)
                except FileNotFoundError:  # removed meanwhile (a concurrent prune)
                    gone.add(digest)
                    continue
                with f:
                    if found != digest:
                        raise UserError(
                            f"cache object {digest[:12]} in {store.url} is damaged",
                            hint="run epbuild build to recompile, then export again",
                        )
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    info.mode = 0o444
                    tar.addfile(info, f)
                report.objects += 1
                report.bytes += info.size
            for entry in entries:
                if any(o.digest in gone for o in entry.outputs.values()):
                    report.problems.append(
                        f"{entry.id}: its entry was removed from the cache while it was "
                        "exported (a prune?); not written"
                    )
                    continue
                raw = entry_bytes(entry)
                info = tarfile.TarInfo(entry_path(entry.key))
                info.size = len(raw)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(raw))
                report.entries += 1
    return report


def _refuse_destination(path: str, cache: str) -> None:
    """Refuse an archive path that is no file of its own: empty, a directory, or inside the
    cache directory (where it would replace an object, or be a file ``prune`` deletes)."""
    hint = "name an archive file outside the cache, e.g. epbuild-cache.tar"
    if not path:
        raise UserError("cache export needs the archive's file name", hint=hint)
    if os.path.isdir(path):
        raise UserError(f"{path} is a directory, not an archive file", hint=hint)
    if inside(os.path.dirname(os.path.abspath(path)), cache):
        raise UnsafePathError(f"{path} is inside the cache directory {cache}", hint=hint)


def import_archive(store: Store, backend: LocalBackend, path: str) -> ArchiveReport:
    """Add an archive's objects and entries to a local store."""
    report = ArchiveReport()
    entries: list[CacheEntry] = []
    try:
        tar = tarfile.open(path, "r|*")  # noqa: SIM115 (closed by the with below)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"{path}: not a cache archive ({exc})") from None
    try:
        with tar:
            for member in tar:
                if not member.isfile():
                    report.problems.append(f"{member.name}: not a regular file; skipped")
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                with src:
                    if m := _OBJECT.fullmatch(member.name):
                        if _import_object(store, backend, m.group(1), src):
                            report.objects += 1
                            report.bytes += member.size
                        else:
                            report.problems.append(f"object {m.group(1)[:12]} is damaged; skipped")
                    elif m := _ENTRY.fullmatch(member.name):
                        try:
                            entries.append(parse_entry(src.read(), m.group(1)))
                        except CorruptEntryError as exc:
                            report.problems.append(str(exc))
                    else:
                        report.problems.append(f"{member.name}: not a cache file; skipped")
    except (tarfile.TarError, OSError, EOFError, _Unreadable) as exc:
        cause = exc.cause if isinstance(exc, _Unreadable) else exc
        why = os_error_text(cause) if isinstance(cause, OSError) else str(cause)
        report.problems.append(f"archive is truncated or damaged ({why}); kept what was whole")
    for entry in entries:
        missing = [o for o in entry.outputs.values() if not store.has_object(o.digest)]
        if missing:
            report.problems.append(f"entry {entry.key[:12]} ({entry.id}) lacks objects; skipped")
            continue
        try:
            store.put_entry(entry)
        except OSError as exc:
            raise _unwritable(store, exc) from exc
        report.entries += 1
    return report


def _import_object(store: Store, backend: LocalBackend, digest: str, src: IO[bytes]) -> bool:
    """Copy one archived object into the cache, hashed on the way; False when its bytes are
    not ``digest`` (dropped). Raises ``_Unreadable`` for the archive's read errors and
    ``StorageError`` for the cache's write errors."""
    h = hashlib.sha256()
    try:
        with trust.sealed_object(backend.root, digest) as tmp:
            with open(tmp, "wb") as f:
                while chunk := _read(src):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != digest:
                raise _Mismatch
    except _Mismatch:
        return False
    except OSError as exc:
        raise _unwritable(store, exc) from exc
    return True


def _read(src: IO[bytes]) -> bytes:
    """The next chunk of an archived file (``_Unreadable``: the archive ends or is bad)."""
    try:
        return src.read(CHUNK)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise _Unreadable(exc) from exc


def _unwritable(store: Store, exc: OSError) -> StorageError:
    return StorageError(
        f"cannot write to the cache {store.url}: {os_error_text(exc)}; nothing more imported",
        hint="check that the cache directory is writable and has free space, "
        "or name another with --cache",
    )


class _Mismatch(Exception):
    """An archived object's bytes are not its digest (it is dropped)."""


class _Unreadable(Exception):
    """The archive could not be read on (truncated, damaged): not the cache's fault."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
