"""A cache backend in object storage through fsspec (``s3://``, ``gs://``, ``file://``, ...).

Object stores make each PUT atomic; on filesystem-like protocols a write goes to a temp name
and is moved into place. fsspec (and s3fs/gcsfs for their protocols) is an optional extra:
``pip install "epbuild[cache-remote]"``.
"""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from epbuild.cache.backend import StoredFile
from epbuild.errors import UserError


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:
        raise UserError(
            "a remote cache URL needs fsspec, which is not installed",
            hint='pip install "epbuild[cache-remote]" (fsspec, s3fs)',
        ) from exc
    return fsspec


class FsspecBackend:
    """Files under an fsspec URL."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        fsspec = _fsspec()
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise UserError(
                f"cache URL {url}: {exc}",
                hint="install the fsspec driver for it (s3fs for s3://, gcsfs for gs://)",
            ) from exc
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self._rename_ok = bool({"file", "local"} & set(protocols))

    def _p(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def read_bytes(self, path: str) -> bytes | None:
        try:
            data = self.fs.cat_file(self._p(path))
        except FileNotFoundError:
            self._check_bucket()
            return None
        return bytes(data)

    def _check_bucket(self) -> None:
        """A missing file is a miss, unless the bucket itself is missing: that is said
        (once per backend) as an ``OSError`` naming the URL, not reported as "no entry"."""
        if getattr(self, "_bucket_seen", False) or self._rename_ok:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            found = bool(self.fs.exists(bucket))
        except OSError:
            found = True  # cannot tell: leave it to the reads
        if not found:
            raise FileNotFoundError(
                errno.ENOENT, f"bucket {bucket!r} does not exist (or is not visible)", self.url
            )
        self._bucket_seen = True

    def write_bytes(self, path: str, data: bytes) -> None:
        self._put(path, lambda target: self.fs.pipe_file(target, data))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._p(path)))

    def download(self, path: str, dest: str) -> None:
        self.fs.get_file(self._p(path), dest)

    def upload(self, src: str, path: str) -> None:
        self._put(path, lambda target: self.fs.put_file(src, target))

    def _put(self, path: str, write: Any) -> None:
        target = self._p(path)
        if not self._rename_ok:
            write(target)  # an object PUT is atomic
            return
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"
        write(tmp)
        self.fs.mv(tmp, target)

    def listdir(self, path: str) -> list[str]:
        try:
            found = self.fs.ls(self._p(path), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in found)

    def walk(self, path: str) -> Iterator[StoredFile]:
        base = self._p(path)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(full)[len(self.root) + 1 :]
            yield StoredFile(rel, int(info.get("size") or 0), _mtime(info))

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self._p(path))
        except FileNotFoundError:
            pass


def _mtime(info: dict[str, Any]) -> float:
    for name in ("LastModified", "mtime", "updated", "created"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0
