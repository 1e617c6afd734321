"""Shared and exclusive locks on one file: many holders share it, or one holds it alone.

For something many processes use at once and one may remove (a toolchain environment every
running build uses, that ``epbuild toolchains --prune`` deletes), and the exclusive locks of
``locks`` (the workspace's and actions'). The OS releases these when a process dies.

POSIX: ``fcntl.flock`` with ``LOCK_SH`` / ``LOCK_EX``. Windows has no shared lock in the
standard library, only exclusive byte-range locks (``msvcrt.locking``): a shared holder locks
one of ``SLOTS`` bytes, an exclusive one all of them, which it gets only while no shared
holder has a byte — safe, at the price of at most ``SLOTS`` shared holders at once (more
wait for a free slot).
"""

from __future__ import annotations

import os
import sys
import time

from epbuild.fs import open_nofollow, refuse_links

SLOTS = 64
"""Windows: shared holders at once."""
_POLL = 0.05


class Held:
    """A lock this process holds until ``release`` (or exit)."""

    def __init__(self, fd: int, slot: int | None) -> None:
        self._fd: int | None = fd
        self._slot = slot
        """Windows: the byte held (None: all of them, exclusively); unused on POSIX."""

    @property
    def fd(self) -> int | None:
        """The lock file's descriptor while held (a child that inherits it keeps the lock
        held should this process die)."""
        return self._fd

    def release(self) -> None:
        """Give the lock back (closing the file releases it; idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sys.platform == "win32":
                import msvcrt

                start, size = (0, SLOTS) if self._slot is None else (self._slot, 1)
                os.lseek(fd, start, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, size)
        except OSError:
            pass
        finally:
            os.close(fd)


def _open(path: str, within: str | None) -> int:
    """Open (make) the lock file, never through a link: not at ``path``, nor between the
    directory ``within`` and it (`fs.LinkedPathError`); a directory that is there costs no
    ``mkdir`` (a build takes a dozen locks)."""
    if within is not None:
        refuse_links(within, path)
    try:
        return open_nofollow(path, os.O_RDWR | os.O_CREAT)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return open_nofollow(path, os.O_RDWR | os.O_CREAT)


def _try(fd: int, exclusive: bool) -> tuple[bool, int | None]:
    """One non-blocking attempt: (got it, the Windows slot taken — None: all or POSIX)."""
    if sys.platform == "win32":
        import msvcrt
        import random

        ranges = [(0, SLOTS)] if exclusive else [(s, 1) for s in random.sample(range(SLOTS), SLOTS)]
        for start, size in ranges:
            os.lseek(fd, start, os.SEEK_SET)
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, size)
            except OSError:
                continue
            return True, None if exclusive else start
        return False, None
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False, None
    return True, None


def acquire(
    path: str, *, exclusive: bool, timeout: float | None = None, within: str | None = None
) -> Held | None:
    """Take the lock at ``path``, shared or exclusive; wait up to ``timeout`` seconds for a
    holder of the other kind (None: as long as it takes, 0: not at all). None when not got.
    A link at ``path``, or between the directory ``within`` (one epbuild owns) and it, is
    refused (`fs.LinkedPathError`), never followed.

    The lock file may be deleted by whoever holds it exclusively (a prune cleaning up): a
    lock got on a file no longer at ``path`` is dropped and taken again on the new one."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = _open(path, within)
        try:
            got, slot = _try(fd, exclusive)
            if got and _still_there(fd, path):
                return Held(fd, slot)
            if got:
                Held(fd, slot).release()
                continue
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(_POLL)


def _still_there(fd: int, path: str) -> bool:
    """Whether the locked file is still the one at ``path`` (not deleted or replaced)."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
