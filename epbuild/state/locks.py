"""Inter-process locks (``flock`` on POSIX, ``msvcrt`` byte locks on Windows, through
``sharedlock``: the OS releases them when a process dies).

The state lock is held only to read-modify-write state; an action lock is held while that
action compiles and commits. A waiter says once whom it waits for.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from epbuild.docsite import page_url
from epbuild.errors import LockTimeoutError
from epbuild.fs import LinkedPathError, open_nofollow, open_read
from epbuild.state import sharedlock, waiting


def _owner_path(lock_path: str) -> str:
    return lock_path + ".owner"


_local_guard = threading.Lock()
_local: dict[str, threading.Lock] = {}


def _thread_lock(lock_path: str) -> threading.Lock:
    """One in-process lock per lock file: threads of one build queue on it and wake at once,
    instead of polling the file lock (up to ``sharedlock._POLL`` late per hand-over)."""
    with _local_guard:
        return _local.setdefault(os.path.abspath(lock_path), threading.Lock())


def _write_owner(lock_path: str, what: str) -> None:
    """Overwrite the owner note in place: truncating a written file to zero makes ext4 flush
    it on close (``auto_da_alloc``), which cost milliseconds per lock. Never through a link:
    a symbolic link there raises `LinkedPathError`; a file with another name too (a hard
    link) is unlinked here and the note made anew."""
    data = json.dumps(
        {"pid": os.getpid(), "what": what, "host": hostname(), "since": time.time()}
    ).encode()
    path = _owner_path(lock_path)
    try:
        fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT)
        if os.fstat(fd).st_nlink > 1:
            os.close(fd)
            os.unlink(path)
            fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
    except LinkedPathError:
        raise
    except OSError:
        pass


def hostname() -> str:
    """``socket.gethostname()``, without importing ``socket`` where ``uname`` says it."""
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket

    return socket.gethostname()


def read_owner(lock_path: str) -> dict[str, object]:
    """Who last took the lock (pid, what, host), best effort."""
    try:
        with open_read(_owner_path(lock_path)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


class Held:
    """A lock this process holds."""

    __slots__ = ("fd",)

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        """The lock file's descriptor: a child process that inherits it keeps the lock held
        should this process die (None where the platform's lock has none)."""


def waiting_message(lock_path: str, what: str) -> str:
    """The one line a waiter shows: whom it waits for."""
    owner = read_owner(lock_path)
    pid = f" (pid {owner['pid']})" if "pid" in owner else ""
    return f"waiting for {owner.get('what', what)}{pid} to release its lock"


@contextmanager
def hold(
    lock_path: str,
    what: str,
    *,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
    note: bool = True,
    within: str | None = None,
) -> Iterator[Held]:
    """Hold the lock at ``lock_path``; ``what`` names the holder for waiters' messages.
    ``note=False`` writes no owner note beside the lock (for a directory whose listing
    epbuild owns exactly, such as the toolchain root). ``within``: the directory epbuild
    owns that the lock is in (a cache, the state directory); the lock and its note are
    never taken through a link, there or below ``within`` (`fs.LinkedPathError`).

    Waits at most ``timeout`` seconds (None: as long as it takes; the ``--lock-timeout``
    value where a command has one), telling ``on_wait`` once whom it waits for; raises
    `LockTimeoutError` naming the holder when the time is up. A hold that names neither
    takes them from the enclosing ``state.waiting.bounded`` block."""
    own_message = on_wait is not None
    timeout = waiting.policy.timeout if timeout is None else timeout
    on_wait = waiting.policy.on_wait if on_wait is None else on_wait
    deadline = None if timeout is None else time.monotonic() + timeout
    told = False

    def tell() -> None:
        nonlocal told
        if on_wait is not None and not told:
            on_wait(waiting_message(lock_path, what))
            told = True

    def left() -> float:
        return -1 if deadline is None else max(0.0, deadline - time.monotonic())

    local = _thread_lock(lock_path)
    if not local.acquire(blocking=False):
        if own_message:  # another thread of this build: the command's message is for others
            tell()
        if not local.acquire(timeout=left()):
            raise _timed_out(lock_path, what, timeout)
    try:
        lock = _file_lock(lock_path, tell, left, what, timeout, within)
        try:
            if note:
                _write_owner(lock_path, what)
            yield Held(lock.fd)
        finally:
            lock.release()
    finally:
        local.release()


@contextmanager
def try_hold(
    lock_path: str, what: str, *, note: bool = True, within: str | None = None
) -> Iterator[Held | None]:
    """Hold the lock at ``lock_path`` if it is free now (yields None if it is not)."""
    with ExitStack() as stack:
        try:
            held: Held | None = stack.enter_context(
                hold(lock_path, what, timeout=0, on_wait=_silent, note=note, within=within)
            )
        except LockTimeoutError:
            held = None
        yield held


def _silent(message: str) -> None:
    """``try_hold`` does not wait, so it has nothing to say."""


def _file_lock(
    lock_path: str,
    tell: Callable[[], None],
    left: Callable[[], float],
    what: str,
    timeout: float | None,
    within: str | None,
) -> sharedlock.Held:
    """The file lock itself: exclusive, taken on the file at ``lock_path`` (made if need
    be); the same lock filelock's ``FileLock`` takes, so older epbuilds still exclude."""
    held = sharedlock.acquire(lock_path, exclusive=True, timeout=0, within=within)
    if held is None:
        tell()
        wait = left()
        held = sharedlock.acquire(
            lock_path, exclusive=True, timeout=None if wait < 0 else wait, within=within
        )
        if held is None:
            raise _timed_out(lock_path, what, timeout)
    return held


def _timed_out(lock_path: str, what: str, timeout: float | None) -> LockTimeoutError:
    owner = read_owner(lock_path)
    return LockTimeoutError(
        f"timed out after {timeout or 0:g}s waiting for the lock held by "
        f"{owner.get('what', what)} (pid {owner.get('pid', '?')})",
        hint="wait for it to finish, or raise --lock-timeout "
        f"(see {page_url('troubleshooting.md', 'lock-waits')})",
    )
