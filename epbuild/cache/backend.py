"""The storage seam under the cache: a few byte- and file-level operations on relative paths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from epbuild._dataclass import dataclass


@dataclass(frozen=True)
class StoredFile:
    """A file in a backend, as listed."""

    path: str
    """Path relative to the backend root, with ``/`` separators."""
    size: int
    mtime: float
    """Last write (or, for local entries, last use) as a POSIX timestamp."""
    atime: float = 0.0
    """Last access where the backend knows it (a local file's; 0 elsewhere): a local
    object's last use (``LocalBackend.mark_used``)."""


class Backend(Protocol):
    """Where cache files live. Paths are relative, ``/``-separated; writes are atomic."""

    url: str
    """Where this backend points, for messages."""

    def read_bytes(self, path: str) -> bytes | None:
        """The file's content, or None when it does not exist."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace a file atomically (readers see the old or the new content)."""

    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    def download(self, path: str, dest: str, size: int = 0) -> None:
        """Copy a stored file (of about ``size`` bytes, when known) to the local path
        ``dest`` (raises FileNotFoundError)."""

    def upload(self, src: str, path: str) -> None:
        """Store the local file ``src`` atomically under ``path``."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under a directory (empty when it does not exist)."""

    def walk(self, path: str) -> Iterator[StoredFile]:
        """Every file under a directory."""

    def delete(self, path: str) -> None:
        """Remove a file if it exists."""
