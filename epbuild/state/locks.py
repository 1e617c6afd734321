"""Inter-process locks (filelock: the OS releases them when a process dies).

The state lock is held only to read-modify-write state; an action lock is held while that
action compiles and commits. A waiter says once whom it waits for.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from epbuild.errors import LockTimeoutError

_POLL = 0.05


def _owner_path(lock_path: str) -> str:
    return lock_path + ".owner"


_local_guard = threading.Lock()
_local: dict[str, threading.Lock] = {}


def _thread_lock(lock_path: str) -> threading.Lock:
    """One in-process lock per lock file: threads of one build queue on it and wake at once,
    instead of polling the file lock (up to ``_POLL`` late per hand-over)."""
    with _local_guard:
        return _local.setdefault(os.path.abspath(lock_path), threading.Lock())


def _write_owner(lock_path: str, what: str) -> None:
    """Overwrite the owner note in place: truncating a written file to zero makes ext4 flush
    it on close (``auto_da_alloc``), which cost milliseconds per lock."""
    import socket

    data = json.dumps(
        {"pid": os.getpid(), "what": what, "host": socket.gethostname(), "since": time.time()}
    ).encode()
    try:
        fd = os.open(_owner_path(lock_path), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
    except OSError:
        pass


def read_owner(lock_path: str) -> dict[str, object]:
    """Who last took the lock (pid, what, host), best effort."""
    try:
        with open(_owner_path(lock_path), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextmanager
def hold(
    lock_path: str,
    what: str,
    *,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold the lock at ``lock_path``; ``what`` names the holder for waiters' messages."""
    from filelock import FileLock, Timeout

    deadline = None if timeout is None else time.monotonic() + timeout
    told = False

    def tell() -> None:
        nonlocal told
        if on_wait is not None and not told:
            owner = read_owner(lock_path)
            on_wait(
                f"waiting for {owner.get('what', what)} (pid {owner.get('pid', '?')}) "
                "to release its lock"
            )
            told = True

    def timed_out() -> LockTimeoutError:
        owner = read_owner(lock_path)
        return LockTimeoutError(
            f"timed out after {timeout:g}s waiting for the lock held by "
            f"{owner.get('what', what)} (pid {owner.get('pid', '?')})",
            hint="wait for that build to finish, or raise --lock-timeout "
            "(see docs/troubleshooting.md#lock-waits)",
        )

    local = _thread_lock(lock_path)
    if not local.acquire(blocking=False):
        tell()
        left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not local.acquire(timeout=left):
            raise timed_out()
    try:
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        lock = FileLock(lock_path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            tell()
            left = -1 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                lock.acquire(timeout=left, poll_interval=_POLL)
            except Timeout:
                raise timed_out() from None
        try:
            _write_owner(lock_path, what)
            yield
        finally:
            lock.release()
    finally:
        local.release()
