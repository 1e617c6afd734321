"""Outputs that moved: an action's recorded outputs outside the directory the manifest now
puts them in (``[workspace] out_dir`` or ``state_dir`` changed since they were built).

Such an action is stale whatever its key says (``staleness``): its build writes or
restores the outputs in the new place. The old ones are then orphaned outputs: the build
that replaces the action's record keeps them under a record of their own
(``_names.left_id``), which ``status`` lists as orphaned and ``clean --orphaned`` removes. Outside
the output and state directories epbuild deletes a file only while it is still what a build
wrote (``still_written``): the old place is no longer epbuild's, and the user may have
put files of their own there since.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epbuild.state.statcache import StatCache


def moved_from(out_dir: str, outputs: Iterable[str]) -> str | None:
    """The directory the recorded ``outputs`` are in when it is not ``out_dir`` (None: they
    are in place, or there are none)."""
    inside = out_dir + "/"
    for rel in outputs:
        if not rel.startswith(inside):
            return posixpath.dirname(rel)
    return None


def moved_reason(old: str, new: str) -> str:
    """What ``status`` says of an action whose outputs moved."""
    return f"outputs moved from {old} to {new}"


def owning_top(rel: str) -> str:
    """The top directory an action's output was committed under: every action's outputs
    go to ``<top>/<group>/<leaf>/`` (``GraphAction.out_dir``)."""
    return posixpath.dirname(posixpath.dirname(posixpath.dirname(rel)))


def still_written(root: str, rel: str, size: int, digest: str, stats: StatCache) -> bool:
    """Whether ``rel`` is still the regular file a build recorded (``size``, ``digest``):
    the only outputs epbuild deletes outside its own directories. The stat cache vouches for
    a file whose stat it still matches; any other is hashed."""
    full = os.path.join(root, rel)
    try:
        st = os.lstat(full)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        if not owning_top(rel):
            return False  # not <top>/<group>/<leaf>/<name>: no output of epbuild's
        cached = stats.lookup(rel, st)
        found = cached.digest if cached is not None else stats.digest(root, rel, output=True).digest
    except OSError:
        return False
    return found == digest
