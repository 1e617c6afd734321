"""How long a lock waits when its caller says nothing: one command's ``--lock-timeout`` and
where its waiting message goes, for every lock the command takes in any layer below it (the
manifest lock of ``add``, the state lock of ``clean``, the cache's prune lock, ...).

Kept free of imports: the command line enters ``bounded`` before the no-op fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


class _Policy:
    __slots__ = ("on_wait", "timeout")

    def __init__(self) -> None:
        self.timeout: float | None = None
        """Seconds a hold that names no timeout waits at most (None: as long as it takes)."""
        self.on_wait: Callable[[str], None] | None = None
        """Told once whom a hold that names no ``on_wait`` waits for."""


policy = _Policy()
"""This process's policy (``state.locks.hold`` reads it)."""


@contextmanager
def bounded(timeout: float | None, on_wait: Callable[[str], None] | None) -> Iterator[None]:
    """Within this block, every lock hold that names no timeout (or no ``on_wait``) waits at
    most ``timeout`` seconds and tells ``on_wait`` whom it waits for."""
    before = (policy.timeout, policy.on_wait)
    policy.timeout, policy.on_wait = timeout, on_wait
    try:
        yield
    finally:
        policy.timeout, policy.on_wait = before
