"""Shared/exclusive file locks (``state.sharedlock``): flock locks belong to an open file,
so two acquisitions in one process contend as two processes would."""

from __future__ import annotations

import os
from pathlib import Path

from epbuild.state import sharedlock


def test_shared_holders_keep_an_exclusive_taker_out(tmp_path: Path) -> None:
    path = str(tmp_path / "env.use")
    a = sharedlock.acquire(path, exclusive=False, timeout=0)
    b = sharedlock.acquire(path, exclusive=False, timeout=0)
    assert a is not None and b is not None
    assert sharedlock.acquire(path, exclusive=True, timeout=0) is None
    a.release()
    assert sharedlock.acquire(path, exclusive=True, timeout=0) is None
    b.release()
    b.release()  # idempotent
    ex = sharedlock.acquire(path, exclusive=True, timeout=0)
    assert ex is not None
    assert sharedlock.acquire(path, exclusive=False, timeout=0) is None
    ex.release()


def test_a_lock_file_deleted_by_its_holder_is_not_trusted(tmp_path: Path) -> None:
    path = str(tmp_path / "env.use")
    ex = sharedlock.acquire(path, exclusive=True, timeout=0)
    assert ex is not None
    os.unlink(path)  # a prune cleaning up, holding the lock
    shared = sharedlock.acquire(path, exclusive=False, timeout=0)  # the new file
    assert shared is not None and os.path.exists(path)
    assert sharedlock.acquire(path, exclusive=True, timeout=0) is None  # the same new file
    ex.release()
    shared.release()
