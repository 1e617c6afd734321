"""A cache backend in object storage through fsspec (``s3://``, ``gs://``, ``file://``, ...).

Object stores make each PUT atomic; on filesystem-like protocols a write goes to a temp name
and is moved into place. fsspec (and s3fs/gcsfs for their protocols) is an optional extra:
``pip install "epbuild[cache-remote]"``.

This is the seam where a remote's failures are translated: every call either answers, raises
``FileNotFoundError`` (absent: a miss) or raises ``CacheUnavailableError`` — whatever the
driver threw (``EndpointConnectionError``, a 403, a timeout). Every call has a deadline
(``timeout`` seconds without an answer, ``EPBUILD_CACHE_TIMEOUT``; transfers get more time
by their size), so an endpoint that accepts connections but never answers cannot hang a build.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, TypeVar

from epbuild.cache.backend import StoredFile
from epbuild.errors import CacheUnavailableError, UserError

T = TypeVar("T")

TIMEOUT_ENV = "EPBUILD_CACHE_TIMEOUT"
"""Seconds a remote cache call may go without an answer (default ``DEFAULT_TIMEOUT``)."""
DEFAULT_TIMEOUT = 30.0
MIN_RATE = 1 << 20
"""Bytes per second a transfer is allowed to be as slow as, on top of the timeout."""


def configured_timeout() -> float:
    """The remote call timeout: ``EPBUILD_CACHE_TIMEOUT``, else ``DEFAULT_TIMEOUT``."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise UserError(
                f"{TIMEOUT_ENV}={raw!r} is not a number of seconds above 0",
                hint=f"set {TIMEOUT_ENV} to e.g. 30, or unset it",
            )
        return value
    return DEFAULT_TIMEOUT


def _driver_options(protocols: set[str], timeout: float) -> dict[str, Any]:
    """Storage options that make a driver give up in time instead of retrying for minutes
    (s3fs retries 5 times with backoff, botocore again under it)."""
    if protocols & {"s3", "s3a"}:
        return {
            "config_kwargs": {
                "connect_timeout": timeout,
                "read_timeout": timeout,
                "retries": {"max_attempts": 1},
            },
        }
    return {}


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

    def __init__(self, url: str, *, timeout: float | None = None, **storage_options: Any) -> None:
        fsspec = _fsspec()
        self.timeout = configured_timeout() if timeout is None else timeout
        """Seconds one call may go without an answer before the tier counts as down."""
        self.url = url
        protocol = url.split("://", 1)[0].lower()
        options = {**_driver_options({protocol}, self.timeout), **storage_options}
        try:  # local work (imports, configuration): no deadline, nothing is asked yet
            fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError) as exc:
            raise UserError(
                f"cache URL {url}: {exc}",
                hint="install the fsspec driver for it (s3fs for s3://, gcsfs for gs://)",
            ) from exc
        except Exception as exc:
            raise CacheUnavailableError(
                f"remote cache {url}: {type(exc).__name__}: {exc}",
                hint="check the URL and the driver's configuration",
            ) from exc
        if _driver_options({protocol}, self.timeout) and hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own retry loop, above botocore's
        self.fs = fs
        self.root = root.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self._rename_ok = bool({"file", "local"} & set(protocols))

    def _p(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def _call(self, fn: Callable[[], T], what: str, size: int = 0) -> T:
        """Run one driver call with a deadline; translate whatever it raises (but
        ``FileNotFoundError``) into ``CacheUnavailableError``. The call runs in a daemon
        thread: one that never returns is abandoned, not waited for."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=call, name="epbuild-cache-remote", daemon=True).start()
        limit = self.timeout + size / MIN_RATE
        if not done.wait(limit):
            raise CacheUnavailableError(
                f"remote cache {self.url}: no answer to {what} within {limit:g}s",
                hint=f"check the endpoint, or raise {TIMEOUT_ENV} (seconds)",
            )
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, FileNotFoundError):
                raise exc
            if not isinstance(exc, Exception):
                raise exc  # KeyboardInterrupt and friends are not the cache's to swallow
            raise CacheUnavailableError(
                f"remote cache {self.url}: {what} failed: {type(exc).__name__}: {exc}",
                hint="check the endpoint, the credentials and the bucket",
            ) from exc
        value: T = box["value"]
        return value

    def read_bytes(self, path: str) -> bytes | None:
        try:
            data = self._call(lambda: self.fs.cat_file(self._p(path)), f"reading {path}")
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
            found = bool(self._call(lambda: self.fs.exists(bucket), f"looking up {bucket}"))
        except (OSError, CacheUnavailableError):
            found = True  # cannot tell: leave it to the reads
        if not found:
            raise FileNotFoundError(
                errno.ENOENT, f"bucket {bucket!r} does not exist (or is not visible)", self.url
            )
        self._bucket_seen = True

    def write_bytes(self, path: str, data: bytes) -> None:
        self._put(path, lambda target: self.fs.pipe_file(target, data), len(data))

    def exists(self, path: str) -> bool:
        return bool(self._call(lambda: self.fs.exists(self._p(path)), f"looking up {path}"))

    def download(self, path: str, dest: str, size: int = 0) -> None:
        self._call(lambda: self.fs.get_file(self._p(path), dest), f"downloading {path}", size)

    def upload(self, src: str, path: str) -> None:
        size = os.path.getsize(src)
        self._put(path, lambda target: self.fs.put_file(src, target), size)

    def _put(self, path: str, write: Callable[[str], object], size: int) -> None:
        target = self._p(path)
        what = f"writing {path}"
        if not self._rename_ok:
            self._call(lambda: write(target), what, size)  # an object PUT is atomic
            return
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:12]}"

        def put() -> None:
            self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            write(tmp)
            self.fs.mv(tmp, target)

        self._call(put, what, size)

    def listdir(self, path: str) -> list[str]:
        try:
            found = self._call(
                lambda: self.fs.ls(self._p(path), detail=False, refresh=True), f"listing {path}"
            )
        except FileNotFoundError:
            return []
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in found)

    def walk(self, path: str) -> Iterator[StoredFile]:
        base = self._p(path)
        try:
            found = self._call(lambda: self.fs.find(base, detail=True), f"listing {path}")
        except FileNotFoundError:
            return
        for full, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = str(full)[len(self.root) + 1 :]
            yield StoredFile(rel, int(info.get("size") or 0), _mtime(info))

    def delete(self, path: str) -> None:
        try:
            self._call(lambda: self.fs.rm_file(self._p(path)), f"deleting {path}")
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
