"""The no-op fast path: answer "everything is up to date" by stat-ing, before importing more.

When a build finds every selected action up to date, it records a *fingerprint*: the stat
(inode, size, mtime_ns, and the change time but for committed outputs) of the manifest, the
state journal, every input and output whose digest it verified, the version sources of the
providers (site directories, SDK files) and the directories globs were expanded in, and each
LLM package's source files and package files (checked against what the source makes); a path
that does not exist (a toolchain workspace's ``epbuild.lock`` before ``epbuild lock``) is
stamped as absent. The next ``epbuild build`` stats exactly those paths (this module imports
only ``os``, ``sys``, ``json`` and ``tomllib``); if nothing changed it prints the recorded
result without loading the rest of epbuild. Any difference falls back to the full path,
which re-plans from content as always. Every stat stored is taken *before* the value it
vouches for is re-checked, so a change racing with the fingerprint makes it miss, never lie.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from epbuild._names import JOURNAL_NAME, MANIFEST_NAME, NOOP_NAME, state_dir_setting, tomllib

if TYPE_CHECKING:
    from epbuild.planning.actions import CompileAction
    from epbuild.planning.staleness import ActionPlan
    from epbuild.planning.workspace import Workspace
    from epbuild.toolchains.env import Toolchain

_VERSION = 2  # 2: a source's stamp holds its change time


_ABSENT: list[int] = []
"""The stamp of a path that does not exist: creating it later changes the stamp, so absence
vouches like any other stamp (a toolchain workspace without ``epbuild.lock``)."""


def file_stamp(path: str) -> list[int] | None:
    """(inode, size, mtime_ns, ctime_ns), ``_ABSENT`` if nothing is there, None if stat
    cannot say."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return _ABSENT
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _matches(stamp: object, found: list[int] | None) -> bool:
    """Whether a recorded stamp still holds: all four numbers, or the first three for a
    stamp of an output epbuild committed (the stat cache keeps no change time for those,
    see ``epbuild.state.statcache``)."""
    if not isinstance(stamp, list) or not found or found == _ABSENT:
        return stamp == found
    return len(stamp) in (3, 4) and found[: len(stamp)] == stamp


def _dir_stamp(path: str) -> list[int] | None:
    """(inode, mtime_ns): ``file_stamp`` without the size, which says nothing of a directory."""
    found = file_stamp(path)
    return [found[0], found[2]] if found else found


def _racy(stamp: object, written_ns: int) -> bool:
    """A file whose mtime is not older than the fingerprint's own write may have been
    rewritten within one timestamp tick (1–2 s on FAT, HFS+, some NFS) keeping its size and
    inode: its stamp cannot vouch for it (git's racy-index rule). An absent file is never
    racy: whatever creates it changes its stamp."""
    if stamp == _ABSENT:
        return False
    return not isinstance(stamp, list) or len(stamp) not in (3, 4) or stamp[2] >= written_ns


def _state_dir_of(root: str, manifest_bytes: bytes) -> str | None:
    """The state directory the manifest names, if it is a tame relative path (the loader
    refuses the rest, so no fingerprint was ever written outside the workspace)."""
    try:
        data = tomllib.loads(manifest_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    state_dir = state_dir_setting(data)
    if not isinstance(state_dir, str) or state_dir.startswith(("/", "\\")) or ".." in state_dir:
        return None
    return os.path.join(root, state_dir)


def _context(selectors: list[str] | tuple[str, ...]) -> dict[str, Any]:
    from epbuild._version import __version__

    return {"epbuild": __version__, "prefix": sys.prefix, "selectors": list(selectors)}


def fast_noop(
    directory: str, manifest: str | None, selectors: list[str] | tuple[str, ...]
) -> dict[str, Any] | None:
    """The recorded ``--json`` document if nothing changed since it was recorded, else None."""
    path = os.path.join(directory, manifest or MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    root = os.path.dirname(os.path.abspath(path))
    state_dir = _state_dir_of(root, raw)
    if state_dir is None:
        return None
    try:
        with open(os.path.join(state_dir, NOOP_NAME), "rb") as f:
            written = os.fstat(f.fileno()).st_mtime_ns
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    stamp = data.get("manifest")
    if data.get("context") != _context(selectors) or stamp != file_stamp(path):
        return None
    if _racy(stamp, written):  # an edit within the fingerprint's tick (out_dir, say)
        return None
    files = data.get("files", {})
    dirs = data.get("dirs", {})
    if not isinstance(files, dict) or not isinstance(dirs, dict):
        return None
    for rel, stamp in files.items():
        if not _matches(stamp, file_stamp(os.path.join(root, rel))) or _racy(stamp, written):
            return None
    for d, stamp in dirs.items():
        if _dir_stamp(os.path.join(root, d)) != stamp:
            return None
    doc = data.get("result")
    return doc if isinstance(doc, dict) else None


def write_fingerprint(
    ws: Workspace,
    plans: list[ActionPlan],
    selectors: list[str] | tuple[str, ...],
    doc: dict[str, Any],
) -> bool:
    """Record the fingerprint of an all-up-to-date build; returns whether it was written."""
    from epbuild.fs import atomic_write_bytes

    if any(p.stale for p in plans):
        return False
    manifest_stamp = file_stamp(str(ws.manifest.path))
    journal = os.path.join(ws.state_dir, JOURNAL_NAME)
    files: dict[str, list[int] | None] = {os.path.relpath(journal, ws.root): file_stamp(journal)}
    dirs: dict[str, list[int] | None] = {}
    # Version sources, glob directories and LLM sources are stamped first, then re-checked
    # below (the manifest reads each LLM source's genai_config.json).
    if not stamp_sources(ws, files, dirs) or not _stamp_llms(ws, files, dirs):
        return False
    if not still_current(ws):
        return False
    if not _stamp_plans(ws, plans, journal, files):
        return False
    if None in files.values() or None in dirs.values():
        return False
    payload = {
        "version": _VERSION,
        "context": _context(selectors),
        "manifest": manifest_stamp,
        "files": files,
        "dirs": dirs,
        "result": doc,
    }
    atomic_write_bytes(os.path.join(ws.state_dir, NOOP_NAME), json.dumps(payload).encode())
    return True


def stamp_sources(
    ws: Workspace, files: dict[str, list[int] | None], dirs: dict[str, list[int] | None]
) -> bool:
    """Stamp what versions and glob expansions depend on; False if stat cannot vouch."""
    from epbuild.providers import get_provider
    from epbuild.providers.distributions import scanning

    # Site directories: a package install or upgrade changes their listing.
    for site in sys.path:
        if site and os.path.isdir(site):
            dirs[os.path.abspath(site)] = _dir_stamp(site)
    for action in ws.actions:
        toolchain = _stamp_toolchain(ws, action, files, dirs)
        if toolchain is None and action.provider.toolchain is not None:
            return False  # keys came from epbuild.lock: no environment to stamp yet
        version_inputs = get_provider(action.provider.ep).version_inputs
        if toolchain is None:
            extra = version_inputs(action.provider)
        else:
            with scanning(toolchain.sites):
                extra = version_inputs(action.provider)
        if extra is None:
            return False  # this adapter's versions cannot be vouched for by stat
        for path in extra:
            where = os.path.abspath(os.path.join(ws.root, path))
            files[where] = file_stamp(where)
    for group in ws.manifest.groups.values():
        for pattern in group.patterns:
            base = _glob_base(pattern)
            if base is None:
                return False
            dirs[base or "."] = _dir_stamp(os.path.join(ws.root, base))
    for recipe in ws.manifest.quantization.values():  # a new sample joins the calibration
        for folder in recipe.listed:
            dirs[folder] = _dir_stamp(os.path.join(ws.root, folder))
    return True


def _stamp_toolchain(
    ws: Workspace,
    action: CompileAction,
    files: dict[str, list[int] | None],
    dirs: dict[str, list[int] | None],
) -> Toolchain | None:
    """Stamp what a provider's toolchain versions depend on: its site directories, and its
    marker (an environment epbuild made) or its interpreter."""
    from epbuild.toolchains.env import MARKER
    from epbuild.toolchains.lockfile import LOCK_NAME

    toolchain = ws.keys.toolchains.lookup(action.provider)
    if toolchain is None:
        return None
    for site in toolchain.sites:
        dirs[os.path.abspath(site)] = _dir_stamp(site)
    if action.provider.toolchain is not None and action.provider.toolchain.python is None:
        files[os.path.join(toolchain.prefix, MARKER)] = file_stamp(
            os.path.join(toolchain.prefix, MARKER)
        )
        lock = os.path.abspath(os.path.join(action.provider.base_dir or ".", LOCK_NAME))
        files[lock] = file_stamp(lock)  # a (changed) lock names another environment
    else:
        files[toolchain.python] = file_stamp(toolchain.python)
    return toolchain


def _stamp_llms(
    ws: Workspace, files: dict[str, list[int] | None], dirs: dict[str, list[int] | None]
) -> bool:
    """Stamp each LLM's source folder (its listing: a new tokenizer or template file joins
    the package). The source files, prepared graphs and package files are the inputs and
    outputs of the graph's actions (``_stamp_plans``)."""
    for llm in ws.manifest.llms.values():
        dirs[llm.source] = _dir_stamp(os.path.join(ws.root, llm.source))
    return True


def still_current(ws: Workspace) -> bool:
    """Whether the manifest and the toolchain versions are still what the build used."""
    from epbuild.manifest.load import load_manifest
    from epbuild.providers import base as provider_base

    if load_manifest(ws.manifest.path) != ws.manifest:
        return False
    used = {action.id: dict(ws.keys.versions(action)) for action in ws.actions}
    provider_base.forget_dist_info()
    return all(ws.keys.versions(a, fresh=True) == used[a.id] for a in ws.actions)


def _stamp_plans(
    ws: Workspace, plans: list[ActionPlan], journal: str, files: dict[str, list[int] | None]
) -> bool:
    """Stamp every plan's inputs and outputs from the stat cache, if the journal agrees."""
    from epbuild.state.journal import load_state

    state = load_state(journal)
    for plan in plans:
        committed = state.records.committed(plan.action.id)
        if committed is None or plan.key is None or committed[0] != plan.key.key:
            return False
        if plan.action.id in state.interrupted:
            return False
        for rel in [*plan.key.inputs, *committed[1]]:
            entry = ws.stats.dirty.get(rel) or ws.stats.entries.get(rel)
            if entry is None:
                return False  # too fresh to trust (racy mtime): no fingerprint this time
            stamp = [entry.ino, entry.size, entry.mtime_ns]
            if entry.ctime_ns is not None:  # a file hashed as an input, not an output
                stamp.append(entry.ctime_ns)
            files[rel] = stamp
    return True


def forget(state_dir: str) -> None:
    """Drop the fingerprint (a build is about to change things)."""
    try:
        os.unlink(os.path.join(state_dir, NOOP_NAME))
    except OSError:
        pass


def _glob_base(pattern: str) -> str | None:
    """The directory a one-level glob lists, or None for recursive/directory globs."""
    head = pattern.rpartition("/")[0]
    if "**" in pattern or any(c in head for c in "*?["):
        return None
    return head
