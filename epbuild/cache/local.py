"""A cache backend in a local directory: temp file + rename for every write, and restores by
hard link (or reflink) where the filesystem allows, by copy otherwise.

A cache directory may be shared with other users, and epbuild makes no symbolic link in it:
one found there was planted, and is damage (``fs.LinkedPathError``). No operation follows
it: a read or write through one raises, a listing skips it, and each one met is kept in
``links`` for ``prune`` and ``cache verify`` to report and remove (removing a link never
touches what it points at).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from epbuild.cache.backend import StoredFile
from epbuild.cache.layout import local_path
from epbuild.fs import (
    LinkedPathError,
    atomic_copy,
    atomic_write_bytes,
    is_link,
    link_or_copy,
    open_read,
    refuse_links,
    regular_file,
    walk_files,
)


class LocalBackend:
    """Files under a root directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self.links: dict[str, str] = {}
        """The planted links met so far (absolute paths) → where each pointed."""

    def full(self, path: str) -> str:
        """The absolute local path of a stored file."""
        return local_path(self.root, path)

    def checked(self, path: str) -> str:
        """The absolute local path of a stored file, reached through no link (raises
        `LinkedPathError`, noting the link)."""
        full = self.full(path)
        try:
            refuse_links(self.root, full)
        except LinkedPathError as exc:
            self._met(os.fsdecode(exc.filename))
            raise
        return full

    def file(self, path: str) -> str:
        """The absolute local path of a stored regular file, reached through no link
        (raises `LinkedPathError`, or ``FileNotFoundError`` for anything else)."""
        full = self.checked(path)
        regular_file(self.root, full)
        return full

    def _met(self, link: str) -> None:
        if link not in self.links:
            self.links[link] = _target(link)

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open_read(self.checked(path)) as f:
                return f.read()
        except LinkedPathError as exc:
            self._met(os.fsdecode(exc.filename))
            raise
        except FileNotFoundError:
            return None

    def write_bytes(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        atomic_write_bytes(self.checked(path), data, mode=mode, within=self.root)

    def exists(self, path: str) -> bool:
        """Whether a regular file is at ``path``, reached through no link."""
        try:
            self.file(path)
        except OSError:
            return False
        return True

    def download(self, path: str, dest: str, size: int = 0) -> None:
        src = open_read(self.file(path))
        try:
            with src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except OSError as exc:  # a write through an open file names no path: name dest
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, dest) from exc
            raise

    def upload(self, src: str, path: str) -> None:
        atomic_copy(src, self.checked(path), mode=0o444, durable=False, within=self.root)

    def listdir(self, path: str) -> list[str]:
        """Names directly under a directory, its links left out (noted)."""
        try:
            full = self.checked(path)
            names = sorted(os.listdir(full))
        except LinkedPathError:
            return []
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for name in names:
            if is_link(os.path.join(full, name)):
                self._met(os.path.join(full, name))
            else:
                found.append(name)
        return found

    def walk(self, path: str) -> Iterator[StoredFile]:
        """Every regular file under a directory; no link is followed (each is noted)."""
        try:
            base = self.checked(path)
        except LinkedPathError:
            return
        links: list[str] = []
        for full, st in walk_files(base, links):
            rel = os.path.relpath(full, self.root).replace(os.sep, "/")
            yield StoredFile(rel, st.st_size, st.st_mtime, st.st_atime)
        for link in links:
            self._met(link)

    def delete(self, path: str) -> None:
        """Remove a file (a link there is removed itself, never what it points at); one
        reached through a linked directory is not there (the link is noted)."""
        full = self.full(path)
        try:
            refuse_links(self.root, os.path.dirname(full))
        except LinkedPathError as exc:
            self._met(os.fsdecode(exc.filename))
            return
        _unlink(full)

    def touch(self, path: str) -> None:
        """Mark a file as just used (prune evicts least recently used entries first)."""
        try:
            os.utime(self.file(path))
        except OSError:
            pass

    def mark_used(self, path: str) -> None:
        """Mark an object as just used (a concurrent prune spares it for its grace period)
        by its access time alone: an object is the very file a restore linked into the
        outputs, whose mtime the stat cache and the trust records vouch by; moving it
        would make every output linked to it read as changed and be hashed again."""
        try:
            full = self.file(path)
            os.utime(full, ns=(time.time_ns(), os.stat(full).st_mtime_ns))
        except OSError:
            pass

    def materialize(self, path: str, dest: str) -> str:
        """Put a stored file at ``dest``: hard link, else reflink, else copy; says which."""
        return link_or_copy(self.file(path), dest)

    def remove_links(self) -> list[str]:
        """Remove every planted link met so far (never what it points at; one removed or
        replaced since is named too); returns one line per link."""
        lines = []
        for link, target in self.links.items():
            what = f"{link} was a symbolic link to {target} that epbuild did not make"
            try:
                if is_link(link):
                    os.unlink(link)
            except OSError as exc:
                lines.append(f"{what}; not followed, and it cannot be removed ({exc.strerror})")
                continue
            lines.append(f"{what}; not followed, and removed (what it pointed at is untouched)")
        self.links.clear()
        return lines


def _target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
