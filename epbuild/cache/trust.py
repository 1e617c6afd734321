"""Which local cache objects need no re-hash on restore: the stat each had when verified.

An object is verified when epbuild writes it into the local cache (its bytes hashed as they
are written) or fully re-hashes it. Its (inode, size, mtime_ns) at that moment is recorded
in ``v1/verified/ab/<digest>``; a hard-link restore that finds the same stat takes the
digest on trust, as the workspace stat cache does for inputs and outputs (and ccache,
Bazel's disk cache and git's index do for their files). Any write moves the mtime, so a
flipped bit is re-hashed, detected, discarded and recompiled: objects are sealed with an
mtime one second in the past, and a re-hash is recorded only for an mtime older than the
racy window, so a write can never land on the recorded mtime.

What a stat check cannot see — a change that keeps size and mtime (``os.utime`` put back,
bit rot below the filesystem) — is caught only by a full re-hash: ``epbuild verify`` (a
restored output is a hard link to its object: the same bytes) or ``epbuild cache verify``.
A record is only a hint: missing, unreadable or stale, it costs one re-hash.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from epbuild.cache.layout import VERIFIED, local_path, object_path, verified_path
from epbuild.fs import LinkedPathError, atomic_output, atomic_write_bytes, open_read, refuse_links

__all__ = [
    "VERIFIED",
    "adopted_object",
    "forget",
    "is_trusted",
    "record",
    "sealed_object",
    "verified_path",
]
_RACY_NS = 20_000_000  # as in the stat cache: a write in the same tick may keep the mtime
_BACKDATE_NS = 1_000_000_000


def _stat_key(st: os.stat_result) -> bytes:
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns}\n".encode()


def is_trusted(root: str, digest: str, st: os.stat_result) -> bool:
    """Whether the object with stat ``st`` is the one verified as ``digest`` in the directory
    cache at ``root``."""
    path = local_path(root, verified_path(digest))
    try:
        refuse_links(root, path)  # a planted link is no record (`fs.LinkedPathError`)
        with open_read(path) as f:
            return f.read(100) == _stat_key(st)
    except OSError:
        return False


def record(root: str, digest: str, st: os.stat_result) -> None:
    """Note that the object with stat ``st`` was just verified as ``digest`` (best effort).

    Not fsynced: a record lost in a crash costs one re-hash. Skipped for an mtime within the
    racy window (a write in the same clock tick could leave it unchanged).
    """
    if time.time_ns() - st.st_mtime_ns < _RACY_NS:
        return
    with contextlib.suppress(OSError):
        path = local_path(root, verified_path(digest))
        atomic_write_bytes(path, _stat_key(st), durable=False, within=root)


def forget(root: str, digest: str) -> None:
    """Drop an object's record (the object is damaged or gone)."""
    path = local_path(root, verified_path(digest))
    with contextlib.suppress(FileNotFoundError, LinkedPathError):  # a planted link: no record
        refuse_links(root, os.path.dirname(path))
        os.unlink(path)  # a link at the record itself is removed, never followed


@contextlib.contextmanager
def sealed_object(root: str, digest: str) -> Iterator[str]:
    """Yield a temp path to write the object ``digest`` to (and hash it on the way); on a
    clean exit it moves into place read-only and is recorded as verified. Raise inside to
    drop it (a hash mismatch)."""
    final = local_path(root, object_path(digest))
    with atomic_output(final, durable=False, within=root) as tmp:
        yield tmp
        os.chmod(tmp, 0o444)
        then = time.time_ns() - _BACKDATE_NS
        os.utime(tmp, ns=(then, then))
        st = os.stat(tmp)  # a rename keeps inode, size and mtime
    record(root, digest, st)


class _NotAdopted(Exception):
    pass


def adopted_object(root: str, digest: str, src: str, vouched: tuple[int, int, int]) -> bool:
    """Make the file ``src`` the object ``digest`` by a hard link, not a copy: an output
    epbuild committed in its state directory, which its stat cache vouches holds ``digest``
    at the stat ``vouched`` (inode, size, mtime_ns). It becomes read-only, as a restored
    output is (the same file both ways), and is recorded as verified. False where it cannot
    be: no hard links there (another filesystem), the file replaced or written since it was
    vouched for, or an mtime in the racy window; the caller then copies it."""
    final = local_path(root, object_path(digest))
    try:
        with atomic_output(final, durable=False, within=root) as tmp:
            os.link(src, tmp)
            st = os.stat(tmp)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != vouched:
                raise _NotAdopted  # not the file the stat cache vouched for
            if time.time_ns() - st.st_mtime_ns < _RACY_NS:
                raise _NotAdopted  # a write in this clock tick could keep its mtime
            os.chmod(tmp, 0o444)
    except (OSError, _NotAdopted):
        return False
    record(root, digest, st)
    return True
