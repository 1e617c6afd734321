"""Inter-process locks (filelock: the OS releases them when a process dies).

The state lock is held only to read-modify-write state; an action lock is held while that
action compiles and commits. A waiter says once whom it waits for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import LockTimeoutError

_POLL = 0.05


def _owner_path(lock_path: str) -> str:
    return lock_path + ".owner"


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
    import socket

    from filelock import FileLock, Timeout

    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        owner = read_owner(lock_path)
        desc = f"{owner.get('what', what)} (pid {owner.get('pid', '?')})"
        if on_wait is not None:
            on_wait(f"waiting for {desc} to release its lock")
        try:
            lock.acquire(timeout=-1 if timeout is None else timeout, poll_interval=_POLL)
        except Timeout:
            owner = read_owner(lock_path)
            raise LockTimeoutError(
                f"timed out after {timeout:g}s waiting for the lock held by "
                f"{owner.get('what', what)} (pid {owner.get('pid', '?')})",
                hint="wait for that build to finish, or raise --lock-timeout",
            ) from None
    try:
        try:
            with open(_owner_path(lock_path), "w", encoding="utf-8") as f:
                json.dump(
                    {"pid": os.getpid(), "what": what, "host": socket.gethostname(),
                     "since": time.time()}, f,
                )  # fmt: skip
        except OSError:
            pass
        yield
    finally:
        lock.release()
