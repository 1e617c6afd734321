"""The no-op fast path: answer "everything is up to date" by stat-ing, before importing more.

When a build finds every selected action up to date, it records a *fingerprint*: the stat
(inode, size, mtime_ns) of the manifest, the state journal, every input and output whose
digest it verified, the version sources of the providers (site directories, SDK files) and
the directories globs were expanded in. The next ``epbuild build`` stats exactly those paths
(this module imports only ``os``, ``sys`` and ``json``); if nothing changed it prints the
recorded result without loading the rest of epbuild. Any difference falls back to the full
path, which re-plans from content as always. Every stat stored is taken *before* the value
it vouches for is re-checked, so a change racing with the fingerprint makes it miss, never
lie.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from epbuild._names import DEFAULT_STATE_DIR, JOURNAL_NAME, MANIFEST_NAME, NOOP_NAME, tomllib

if TYPE_CHECKING:
    from epbuild.planning.staleness import ActionPlan
    from epbuild.state.workspace import Workspace

_VERSION = 1


def _stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def _dir_stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_mtime_ns]


def _state_dir_of(root: str, manifest_bytes: bytes) -> str | None:
    try:
        data = tomllib.loads(manifest_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    state_dir = data.get("workspace", {}).get("state_dir", DEFAULT_STATE_DIR)
    if not isinstance(state_dir, str) or state_dir.startswith("/") or ".." in state_dir:
        return None
    return os.path.join(root, state_dir)


def _context(selectors: list[str] | tuple[str, ...]) -> dict[str, Any]:
    from epbuild import __version__

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
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    if data.get("context") != _context(selectors) or data.get("manifest") != _stamp(path):
        return None
    files = data.get("files", {})
    dirs = data.get("dirs", {})
    if not isinstance(files, dict) or not isinstance(dirs, dict):
        return None
    for rel, stamp in files.items():
        if _stamp(os.path.join(root, rel)) != stamp:
            return None
    for d, stamp in dirs.items():
        if _dir_stamp(os.path.join(root, d)) != stamp:
            return None
    doc = data.get("result")
    return doc if isinstance(doc, dict) else None


def write_fingerprint(
    ws: Workspace, plans: list[ActionPlan], selectors: list[str] | tuple[str, ...],
    doc: dict[str, Any],
) -> bool:  # fmt: skip
    """Record the fingerprint of an all-up-to-date build; returns whether it was written."""
    from epbuild.fs import atomic_write_bytes
    from epbuild.manifest.load import load_manifest
    from epbuild.providers import base as provider_base
    from epbuild.providers import get_provider
    from epbuild.state.journal import load_state

    if any(p.stale for p in plans):
        return False
    root = ws.root
    files: dict[str, list[int] | None] = {}
    dirs: dict[str, list[int] | None] = {}
    manifest_stamp = _stamp(str(ws.manifest.path))
    journal = os.path.join(ws.state_dir, JOURNAL_NAME)
    files[os.path.relpath(journal, root)] = _stamp(journal)
    # Version sources: site directories (a package install or upgrade changes their
    # listing) and adapter-specific files; stamped first, then re-checked below.
    for site in sys.path:
        if site and os.path.isdir(site):
            dirs[os.path.abspath(site)] = _dir_stamp(site)
    for action in ws.actions:
        adapter = get_provider(action.provider.ep)
        version_inputs = getattr(adapter, "version_inputs", None)
        extra = version_inputs(action.provider) if version_inputs else None
        if extra is None:
            return False  # this adapter's versions cannot be vouched for by stat
        for path in extra:
            files[os.path.abspath(os.path.join(root, path))] = _stamp(path)
    for group in ws.manifest.groups.values():
        for pattern in _patterns_of(ws, group.name):
            base = _glob_base(pattern)
            if base is None:
                return False
            dirs[base or "."] = _dir_stamp(os.path.join(root, base))
    # Now re-check that what the build used is still what is there.
    if load_manifest(ws.manifest.path) != ws.manifest:
        return False
    provider_base._DIST_INFO = None
    for action in ws.actions:
        if get_provider(action.provider.ep).versions(action.provider) != ws.keys.versions(action):
            return False
    state = load_state(journal)
    for plan in plans:
        rec = state.records.get(plan.action.id)
        if rec is None or plan.key is None or rec.key != plan.key.key:
            return False
        if plan.action.id in state.interrupted:
            return False
        for rel in [*plan.key.inputs, *rec.outputs]:
            entry = ws.stats.dirty.get(rel) or ws.stats.entries.get(rel)
            if entry is None:
                return False  # too fresh to trust (racy mtime): no fingerprint this time
            files[rel] = [entry.ino, entry.size, entry.mtime_ns]
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


def forget(state_dir: str) -> None:
    """Drop the fingerprint (a build is about to change things)."""
    try:
        os.unlink(os.path.join(state_dir, NOOP_NAME))
    except OSError:
        pass


def _patterns_of(ws: Workspace, group: str) -> list[str]:
    with open(ws.manifest.path, "rb") as f:
        data = tomllib.load(f)
    models = data.get("groups", {}).get(group, {}).get("models", [])
    return [m for m in models if any(c in m for c in "*?[")]


def _glob_base(pattern: str) -> str | None:
    """The directory a one-level glob lists, or None for recursive/directory globs."""
    head = pattern.rpartition("/")[0]
    if "**" in pattern or any(c in head for c in "*?["):
        return None
    return head
