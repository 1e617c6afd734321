"""Damage a stat cannot see, found by a check: recorded so that the next build rebuilds.

``verify`` and ``open_action(check="hash")`` hash outputs the stat cache vouched for (same
inode, size and mtime). When the bytes differ, the action is made stale in the journal
(``Journal.damaged``), its stat-cache entries are dropped and the no-op fingerprint with them.
"""

from __future__ import annotations

import os

from epbuild.errors import EpbuildError
from epbuild.planning.workspace import Workspace
from epbuild.state import waiting
from epbuild.state.journal import Damage

RECORD_WAIT = 60.0
"""Seconds a check waits at most for the state lock to record damage (less where the
command's ``--lock-timeout`` says less): the check's verdict does not wait on it."""


def record_damage(ws: Workspace, action_id: str, checked: dict[str, str], by: str) -> str | None:
    """Make a committed action stale because a check (``by``) found some of its outputs
    (``checked``: path → the digest its journal record holds) with other bytes, so that
    the next build rebuilds it whatever the stat cache says of the files.

    Under the state lock (commits hold it) the record must still be the one checked and
    each file is hashed again: a build that replaced the outputs meanwhile is not marked.
    Returns a warning when the damage could not be recorded (a read-only state
    directory, a lock held too long), else None."""
    from epbuild.planning.noop import forget
    from epbuild.state import locks
    from epbuild.state.statcache import hash_file

    if not checked or not os.path.isdir(ws.state_dir):
        return None
    try:
        bound = waiting.policy.timeout
        wait = RECORD_WAIT if bound is None else min(bound, RECORD_WAIT)
        with locks.hold(ws.state_lock, f"epbuild {by} (recording damage)", timeout=wait):
            rec = ws.reload_state().records.get(action_id)
            damaged = []
            for rel, digest in sorted(checked.items()):
                out = rec.outputs.get(rel) if rec is not None else None
                if out is None or out.digest != digest:
                    return None  # rebuilt (or forgotten) since the check
                try:
                    same = hash_file(os.path.join(ws.root, rel)) == digest
                except OSError:
                    same = False
                if not same:
                    damaged.append(rel)
            if not damaged:
                return None
            ws.journal.damaged(action_id, Damage(tuple(damaged), by))
            ws.stats.forget(damaged)
            ws.stats.save()
            forget(ws.state_dir)
            ws.reload_state()
    except (OSError, EpbuildError) as exc:
        return f"{action_id}: could not record the damage for the next build ({exc})"
    return None
