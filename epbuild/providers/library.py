"""The sha256 of an EP library file, stat-cached per machine.

An EP rebuilt or patched under the same version number compiles differently, so the library
that compiles goes into the action keys by content (``planning.keys``) and into
``epbuild.lock``. Hashing a library costs milliseconds to tens of milliseconds, so digests
are kept in ``ep-libraries.json`` in the per-user cache directory, keyed by the file's
absolute path and trusted while its (inode, size, mtime) holds, as the stat cache does for
inputs.
"""

from __future__ import annotations

import json
import os
import threading
import time

from epbuild.fs import atomic_write_bytes, new_sha256
from epbuild.userdirs import default_cache_dir

KEY = "ep-library"
"""The version key holding the sha256 of the EP library that compiles."""
_RACY_NS = 20_000_000
"""A file modified this recently may change again within its mtime tick: not remembered."""

_lock = threading.Lock()
_memo: dict[str, list[object]] | None = None


def _memo_path() -> str:
    return os.path.join(default_cache_dir(), "ep-libraries.json")


def _load() -> dict[str, list[object]]:
    global _memo
    if _memo is None:
        try:
            with open(_memo_path(), encoding="utf-8") as f:
                data = json.load(f)
            _memo = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _memo = {}
    return _memo


def library_sha256(path: str) -> str:
    """The sha256 hex digest of the library at ``path``, or ``"absent"`` if it is missing."""
    full = os.path.abspath(path)
    try:
        st = os.stat(full)
    except OSError:
        return "absent"
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns]
    with _lock:
        memo = _load()
        hit = memo.get(full)
        if isinstance(hit, list) and len(hit) == 4 and hit[:3] == stamp:
            return str(hit[3])
    digest = new_sha256(st.st_size)
    try:
        with open(full, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return "absent"
    value = digest.hexdigest()
    if time.time_ns() - st.st_mtime_ns >= _RACY_NS:
        _remember(full, [*stamp, value])
    return value


def _remember(full: str, entry: list[object]) -> None:
    with _lock:
        memo = _load()
        memo[full] = entry
        try:
            os.makedirs(os.path.dirname(_memo_path()), exist_ok=True)
            atomic_write_bytes(_memo_path(), json.dumps(memo, indent=0).encode())
        except OSError:
            pass  # hashed again next time
