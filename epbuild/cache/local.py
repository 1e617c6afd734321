"""A cache backend in a local directory: temp file + rename for every write, and restores by
hard link (or reflink) where the filesystem allows, by copy otherwise."""

from __future__ import annotations

import os
from collections.abc import Iterator

from epbuild.cache.backend import StoredFile
from epbuild.cache.layout import local_path
from epbuild.fs import atomic_copy, atomic_write_bytes, link_or_copy


class LocalBackend:
    """Files under a root directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def full(self, path: str) -> str:
        """The absolute local path of a stored file."""
        return local_path(self.root, path)

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open(self.full(path), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_bytes(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        atomic_write_bytes(self.full(path), data, mode=mode)

    def exists(self, path: str) -> bool:
        return os.path.isfile(self.full(path))

    def download(self, path: str, dest: str, size: int = 0) -> None:
        import shutil  # (a restore links its objects: no shutil on its path)

        shutil.copyfile(self.full(path), dest)

    def upload(self, src: str, path: str) -> None:
        atomic_copy(src, self.full(path), mode=0o444, durable=False)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.full(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, path: str) -> Iterator[StoredFile]:
        base = self.full(path)
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                yield StoredFile(rel, st.st_size, st.st_mtime)

    def delete(self, path: str) -> None:
        _unlink(self.full(path))

    def touch(self, path: str) -> None:
        """Mark a file as just used (prune evicts least recently used entries first)."""
        try:
            os.utime(self.full(path))
        except OSError:
            pass

    def materialize(self, path: str, dest: str) -> str:
        """Put a stored file at ``dest``: hard link, else reflink, else copy; says which."""
        return link_or_copy(self.full(path), dest)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
