"""Whether the recorded outputs of actions are what a build committed: the check that
opening built models (``runtime.open_action``) and packaging them (``shipping.package``)
make before they trust an output."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epbuild.errors import NotBuiltError
from epbuild.planning.moves import moved_from

if TYPE_CHECKING:
    from epbuild.planning.actions import CompileAction
    from epbuild.planning.workspace import Workspace
    from epbuild.state.journal import ActionRecord, State

OutputStat = tuple[int, int, int]
"""(inode, size, mtime_ns) of a file; None when it is not a regular file."""


def stat_of(root: str, rel: str) -> OutputStat | None:
    """(inode, size, mtime_ns) of a workspace-relative file; None unless a regular file."""
    import stat

    try:
        st = os.lstat(os.path.join(root, rel))
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def committed_outputs(
    ws: Workspace, actions: Sequence[CompileAction], *, rehash: bool = False
) -> dict[str, OutputStat | None]:
    """The stats of every recorded output of ``actions``, once they are checked to be what
    the journal says a build committed; otherwise ``NotBuiltError`` naming the action.

    Sizes come from the journal and digests from the stat cache while a file's stat still
    matches it; a file whose stat changed is re-hashed (every file with ``rehash``)."""
    from epbuild.planning.damage import record_damage
    from epbuild.planning.staleness import outputs_intact
    from epbuild.state.statcache import hash_file

    state = ws.state
    snapshot: dict[str, OutputStat | None] = {}
    for a in actions:
        build = f"run 'epbuild build {a.group.name}/{a.provider.name}'"
        rec = _complete_record(state, a, build)
        problems: list[str] = []
        for rel in rec.outputs:
            snapshot[rel] = stat_of(ws.root, rel)
            if snapshot[rel] is None:
                gone = not os.path.lexists(os.path.join(ws.root, rel))
                problems.append(f"output {rel} is {'missing' if gone else 'not a file'}")
        recorded = {rel: (o.size, o.digest) for rel, o in rec.outputs.items()}
        try:
            problems = problems or outputs_intact(ws.root, ws.stats, recorded)
            if not problems and rehash:
                changed = {
                    rel: digest
                    for rel, (_, digest) in recorded.items()
                    if hash_file(os.path.join(ws.root, rel)) != digest
                }
                problems = [f"output {rel} was modified" for rel in changed]
                # The stat cache vouched for these files (same inode, size and mtime): only
                # a recorded damage makes the next build rebuild them.
                record_damage(ws, a.id, changed, 'open_action(check="hash")')
        except OSError as exc:
            problems = [f"cannot read output {exc.filename}: {exc.strerror}"]
        if problems:
            raise NotBuiltError(
                f"{a.id} is not as its last build left it: {problems[0]}", hint=build
            )
    return snapshot


def _complete_record(state: State, a: CompileAction, build: str) -> ActionRecord:
    """The action's record, if its last build completed and put every ctx model where the
    manifest puts them now; otherwise ``NotBuiltError`` saying why (``build``: the hint)."""
    if a.id in state.damaged:
        raise NotBuiltError(f"{a.id}: {state.damaged[a.id].reason()}", hint=build)
    if a.id in state.interrupted:
        raise NotBuiltError(
            f"{a.id}: its last build was interrupted while committing its outputs", hint=build
        )
    rec = state.records.get(a.id)
    if rec is None:
        raise NotBuiltError(f"{a.id} has not been built", hint=build + " first")
    old = moved_from(a.out_dir, rec.outputs)
    if old is not None:
        raise NotBuiltError(
            f"{a.id}: its outputs are in {old}; the manifest now puts them in {a.out_dir}",
            hint=build,
        )
    absent = [rel for rel in a.ctx_paths if rel not in rec.outputs]
    if absent:
        raise NotBuiltError(
            f"{a.id}: {absent[0]} is not among the outputs of its last build "
            "(the group changed since)",
            hint=build,
        )
    return rec
