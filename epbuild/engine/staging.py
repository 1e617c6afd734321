"""Staging and committing outputs: check what a worker wrote, then move it into place.

A worker writes into ``<out_dir>/.staging/<slug>-<pid>/``. The coordinator checks every path
written into the staged models (relative, inside the action's directory, existing), that no
free text of a ctx model names a directory of the build machine and no file holds the
(long) workspace path, then — with a ``begin`` record in the journal — removes the action's
old outputs, renames the staged files into place and records ``done``.
"""

from __future__ import annotations

import os
import posixpath
import stat
import sys
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from epbuild._names import STAGING_DIR
from epbuild.errors import StorageError, UnsafePathError, VerificationError
from epbuild.fs import (
    digest_file,
    ensure_dir_inside,
    inside,
    is_link,
    os_error_text,
    refuse_links,
    remove_tree,
)
from epbuild.state import journalfile

if TYPE_CHECKING:
    from epbuild.state.journal import OutputRecord

WRITE_HINT = (
    "check that the output and state directories are writable and have free space, and the "
    "file-size limit (ulimit -f); then build again"
)


def staging_root(root: str, out_dir: str) -> str:
    """Absolute path of the staging area inside the output directory."""
    return os.path.join(root, out_dir, STAGING_DIR)


def make_staging(root: str, out_dir: str, slug: str) -> str:
    """Create a fresh staging directory; returns it workspace-relative."""
    ensure_dir_inside(os.path.join(root, out_dir), root, what="out_dir")
    base = staging_root(root, out_dir)
    refuse_links(os.path.join(root, out_dir), base)  # epbuild makes no link there
    ensure_dir_inside(base, root, what="staging directory")
    rel = posixpath.join(out_dir, STAGING_DIR, f"{slug}-{os.getpid()}")
    full = os.path.join(root, rel)
    remove_tree(full)
    os.mkdir(full)
    return rel


def clean_stale_staging(root: str, out_dir: str) -> None:
    """Remove staging directories of processes that no longer run (never through a link
    planted at the staging area: `make_staging` refuses it, naming it)."""
    base = staging_root(root, out_dir)
    if is_link(base):
        return
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid = name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            remove_tree(os.path.join(base, name))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (when unsure: yes, so its staging is kept)."""
    if pid == os.getpid():
        return True
    if sys.platform == "win32":
        return _alive_windows(pid)
    try:
        os.kill(pid, 0)  # signal 0 only checks; on Windows os.kill would terminate it
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _alive_windows(pid: int) -> bool:
    """``OpenProcess`` + ``GetExitCodeProcess`` is ``STILL_ACTIVE``."""
    import ctypes
    from ctypes import wintypes

    query_limited_information, still_active, invalid_parameter = 0x1000, 259, 87
    try:
        kernel32: Any = getattr(ctypes, "windll").kernel32  # noqa: B009  (absent off Windows)
        handle = kernel32.OpenProcess(query_limited_information, False, pid)
        if not handle:  # no such process, or one we may not query (another user's): alive
            return bool(kernel32.GetLastError() != invalid_parameter)
        try:
            code = wintypes.DWORD()
            if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
                return True
            return code.value == still_active
        finally:
            kernel32.CloseHandle(handle)
    except (OSError, AttributeError):
        return True


def hash_staged(
    root: str,
    staging: str,
    out_dir: str,
    names: list[str],
    kept: Callable[[str, os.stat_result], OutputRecord | None] | None = None,
) -> dict[str, OutputRecord]:
    """Size and digest of each staged output, refusing any that holds the workspace path.
    ``kept`` gives the record of a staged file that is the output already in place (a job
    kept the file it would have written the same): it is not read again, as it was scanned
    when it was written.

    Files are read in pieces (memory stays flat at any model size), and that one read also
    scans the bytes for the workspace path followed by a separator, only where that string
    is long enough never to occur by chance (`epbuild.onnx.context.LONG_PATH_MIN`): opaque
    context binaries and initializers hold any short string somewhere.
    """
    from epbuild.onnx.context import needle_problem, scan_needles
    from epbuild.state.journal import OutputRecord

    needles = scan_needles(root)
    records: dict[str, OutputRecord] = {}
    for name in names:
        path = os.path.join(root, staging, name)
        known = kept(name, os.lstat(path)) if kept is not None else None
        if known is not None:
            records[posixpath.join(out_dir, name)] = known
            continue
        digest = digest_file(path, needles)
        problem = needle_problem(name, digest.found)
        if problem is not None:
            raise VerificationError(problem.line())
        records[posixpath.join(out_dir, name)] = OutputRecord(digest.size, digest.sha256)
    return records


def refuse_links_below(root: str, top: str, rel: str) -> None:
    """Refuse (`fs.LinkedPathError`) a link between the directory ``root/top`` that epbuild
    owns (the output or the state directory) and ``root/rel``, where ``rel`` is below it:
    epbuild makes none there, so one was planted."""
    base, path = os.path.join(root, top), os.path.join(root, rel)
    if path == base or path.startswith(base.rstrip(os.sep) + os.sep):
        refuse_links(base, path)


def refuse_planted_links(root: str, out_dir: str, state_dir: str, paths: list[str]) -> None:
    """Before a build writes anything: refuse a link planted at the staging area or on the
    way to any of ``paths`` (workspace-relative: the actions' output directories, lock
    files and owner notes), each under the output or the state directory (exit 2 naming
    it, rather than failing each action that meets it)."""
    refuse_links_below(root, out_dir, posixpath.join(out_dir, STAGING_DIR))
    for rel in paths:
        refuse_links_below(root, state_dir, rel)
        refuse_links_below(root, out_dir, rel)


def check_removable(root: str, top: str, rels: list[str]) -> None:
    """Refuse to delete recorded outputs whose directory resolves outside ``root/top``.

    ``top`` is the workspace's out_dir: a directory under it replaced by a symlink that leads
    elsewhere must never make epbuild delete the files it points at; one that leads inside
    it is refused too (`fs.LinkedPathError`): epbuild makes no link there.
    """
    base = os.path.join(root, top)
    for rel in rels:
        parent = os.path.dirname(os.path.join(root, rel))
        if os.path.lexists(parent) and not inside(parent, base):
            raise UnsafePathError(
                f"{posixpath.dirname(rel)} resolves to {os.path.realpath(parent)!r}, outside "
                f"the output directory {top}; refusing to delete through it",
                hint="remove the symlink (epbuild owns everything under out_dir)",
            )
        refuse_links_below(root, top, posixpath.dirname(rel))


def commit(
    root: str,
    staging: str,
    out_dir: str,
    names: list[str],
    old: list[str],
    unchanged: Collection[str] = (),
) -> None:
    """Replace an action's old outputs with the staged ones (caller journals begin/done).
    The names in ``unchanged`` are outputs already in place with the staged bytes: they stay
    as they are (their staged copies go with the staging directory)."""
    target = os.path.join(root, out_dir)
    top = posixpath.dirname(posixpath.dirname(out_dir))  # <out_dir>/<group>/<provider>
    ensure_dir_inside(os.path.join(root, top), root, what="output directory")
    ensure_dir_inside(target, os.path.join(root, top), what="output directory")
    refuse_links(os.path.join(root, top), target)
    check_removable(root, top, old)
    for rel in old:
        path = os.path.join(root, rel)
        if os.path.lexists(path) and posixpath.basename(rel) not in names:
            os.unlink(path)
    for name in names:
        if name not in unchanged:
            os.replace(os.path.join(root, staging, name), os.path.join(target, name))
    remove_tree(os.path.join(root, staging))


def refuse_in_the_way(root: str, out_dir: str, names: list[str], action_id: str) -> None:
    """Before anything is touched: refuse a directory where an output file goes (it cannot
    be replaced by a rename; epbuild never made it, so it is not removed either)."""
    for name in names:
        rel = posixpath.join(out_dir, name)
        try:
            st = os.lstat(os.path.join(root, rel))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(
                f"{rel} is a directory, where {action_id} puts an output file",
                hint="move that directory away (epbuild owns everything under out_dir), "
                "then build again",
            )


def commit_journaled(
    root: str,
    journal: str,
    staged: tuple[str, str, list[str]],
    old: list[str],
    done: dict[str, Any],
    remember: Callable[[str, os.stat_result, str], None],
    *,
    durable: bool,
    unchanged: Collection[str] = (),
) -> None:
    """The commit protocol, for every kind and both restore paths (callers hold the state
    lock): ``begin`` in the journal at ``journal`` → the ``staged`` outputs (staging
    directory, action output directory, file names) renamed over the ``old`` ones → each
    output's stat handed to ``remember`` with its digest → the ``done`` record (a journal
    ``done`` line: ``op``, then the record's JSON). So the journal never says ``done`` for
    outputs that are not there. ``durable=False`` leaves the done record's fsync to the
    build's final journal sync: for restores, where losing it costs a re-restore.
    ``unchanged``: see ``commit``."""
    staging, out_dir, names = staged
    refuse_in_the_way(root, out_dir, names, done["id"])
    try:
        journalfile.append(journal, journalfile.begin_line(done["id"], done["key"]), sync=False)
    except OSError as exc:  # nothing touched yet: the old outputs and record stand
        raise StorageError(
            f"cannot write the state journal ({os_error_text(exc, root)}); "
            "the previous outputs were left as they were",
            hint=WRITE_HINT,
        ) from exc
    try:
        commit(root, staging, out_dir, names, old, unchanged)
        for rel, out in done["outputs"].items():
            remember(rel, os.stat(os.path.join(root, rel)), out["digest"])
    except OSError as exc:  # the journal ends with begin: the action reads as stale
        raise StorageError(
            f"cannot put the outputs in place in {out_dir} "
            f"({os_error_text(exc, root)}); the action is recorded as not built",
            hint=WRITE_HINT,
        ) from exc
    try:
        journalfile.append(journal, done, sync=durable)
    except OSError as exc:
        raise StorageError(
            f"the outputs are in place but the state journal cannot record them "
            f"({os_error_text(exc, root)}); the action is recorded as not built",
            hint=WRITE_HINT,
        ) from exc
