"""The restore memo: a fresh checkout's build from a directory cache without planning.

Restoring a workspace from a directory cache costs little work (hash the inputs, link the
outputs, append to the journal), but the full path first loads the manifest, the providers
and the planner to compute every action's key: most of a small restore is that start-up.
As the no-op fingerprint is a stat memo of a no-op, the restore memo is a content memo of
a whole restore. The full path writes it into the cache directory
(``v1/restores/<address>.json``, ``cache.layout``) after a build that left every action
committed and stored; its address is a digest of epbuild's version, the interpreter, the
host, the manifest's name and bytes and the cache directory — not the workspace's path: a
checkout anywhere restores alike, unless a restored ctx model's text holds an absolute path
(the full path checks those against the checkout's path; such a memo is bound to its
own). It lists what planning read and what restoring wrote:

- the distributions installed in every ``sys.path`` directory (their metadata directories'
  names, which hold their versions) and the stat of every other version source of the
  providers (the EP library, the SDK's version file: as the no-op fingerprint stamps them),
  and the listing of every directory a glob expanded in;
- every input file's sha256 (models, external data);
- for every action: its cache entry's sha256, and the journal record and the result a full
  restore of that entry writes.

``fast_restore`` (``build``, with ``--cache-only`` or not; imports ``os``, ``json``,
``hashlib`` and epbuild's bottom modules) checks all of it against the checkout — the inputs
by content, never by stat — and, only for a workspace with no journal and none of the
outputs, restores under the same locks as the full path (every action's, then every key's,
then the state lock), through the same commit protocol (``staging.commit_journaled``): every
object is linked and verified (its stat trusted as the full path trusts it, else re-hashed)
before anything is committed. Any difference, damage or surprise before the first commit
returns None and the full path runs, which re-plans from content as always; a failure after
it leaves a journal the full path continues from. It compares recorded content; it never computes a
key. Written only for plain workspaces: compile actions of epbuild's own environment, no
file-valued provider options, no LLMs or quantization, one-level globs, a directory cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from epbuild._names import (
    CTX_SUFFIX,
    JOURNAL_NAME,
    LOCKS_DIR,
    STATCACHE_NAME,
    STATE_LOCK_NAME,
    TRACE_NAME,
)
from epbuild.cache import layout, trust
from epbuild.cache.layout import local_path
from epbuild.engine.staging import clean_stale_staging, commit_journaled, make_staging
from epbuild.fs import digest_file, is_safe_reference, link_or_copy, os_error_text, remove_tree
from epbuild.planning import noop
from epbuild.state import journalfile, locks

if TYPE_CHECKING:
    from epbuild.engine.trace import Tracer
    from epbuild.planning.staleness import ActionPlan
    from epbuild.planning.workspace import Workspace
    from epbuild.state.statcache import StatCache

_VERSION = 1
NEVER_BUILT = "never built"
"""The reason every action of a fresh checkout is stale (``planning.staleness``)."""


def _context(manifest: str, raw: bytes, cache_dir: str) -> dict[str, Any]:
    """What a memo answers for: this epbuild, interpreter (``sys.path`` with the current
    directory, which ``python -m`` puts there, as ``CWD``: its distributions are compared
    like any site's), host, manifest (name and bytes) and cache directory. Not
    the workspace's path: a checkout anywhere restores alike (a memo of ctx models whose
    text holds absolute paths is bound to its path: ``root`` in the memo)."""
    from epbuild._version import __version__

    return {
        "format": _VERSION,
        "epbuild": __version__,
        "python": [sys.version, sys.prefix, sys.executable, _sys_path()],
        "host": _host(),  # stats vouch on one machine: machines sharing a cache keep theirs
        "manifest": [os.path.basename(manifest), hashlib.sha256(raw).hexdigest()],
        "cache": cache_dir,
    }


CWD = "<cwd>"
"""``sys.path``'s entry for the current directory, in a memo."""


def _sys_path() -> list[str]:
    cwd = os.getcwd()
    return [CWD if p in ("", cwd) else p for p in sys.path]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _host() -> str:
    """This machine's name (``locks``' owner notes use the same)."""
    from epbuild.state.locks import hostname

    return hostname()


def memo_path_of(manifest: str, raw: bytes, cache_dir: str) -> str:
    """The cache-relative path of the memo of a workspace (its manifest's path and bytes)
    restoring from ``cache_dir``."""
    return layout.restore_path(_digest(_context(manifest, raw, cache_dir)))


_DIST_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")


def _distributions(site: str) -> list[str] | None:
    """What a site directory says is installed there (distribution metadata, path files; a
    name holds its version): compared by content, so that creating a checkout in the
    current directory (which ``python -m`` puts on ``sys.path``) is not an install."""
    try:
        return sorted(n for n in os.listdir(site) if n.endswith(_DIST_SUFFIXES))
    except FileNotFoundError:
        return []
    except OSError:
        return None


def _listing(root: str, rel: str, own: frozenset[str]) -> list[str] | None:
    """The names in a glob's directory (``name/`` for a directory), epbuild's own
    directories (``own``, workspace-relative) left out; None when it cannot be listed."""
    try:
        with os.scandir(os.path.join(root, rel)) as it:
            names = [e.name + "/" if e.is_dir() else e.name for e in it]
    except OSError:
        return None
    return sorted(n for n in names if posixpath.normpath(f"{rel}/{n.rstrip('/')}") not in own)


def _own_dirs(root: str, settings: tuple[str, str, str]) -> frozenset[str]:
    """The output, state and (inside the workspace) cache directories, workspace-relative:
    a fresh checkout lacks them, and globs never match inside them."""
    out_dir, state_dir, cache_dir = settings
    own = {posixpath.normpath(out_dir), posixpath.normpath(state_dir)}
    rel = os.path.relpath(cache_dir, root)
    if rel != ".." and not rel.startswith(".." + os.sep):
        own.add(posixpath.normpath(rel.replace(os.sep, "/")))
    return frozenset(own)


# -- the fast path -------------------------------------------------------------------------


class _Miss(Exception):
    """The memo does not answer: the full path runs."""


def fast_restore(
    directory: str,
    manifest: str | None,
    cache_option: str | bool | None,
    lock_timeout: float | None,
) -> dict[str, Any] | None:
    """Restore the workspace from its memo; the ``--json`` document of the build, or None
    when the memo does not answer (nothing was committed: run the full path)."""
    from epbuild.engine.trace import Tracer

    t0, tracer = time.perf_counter(), Tracer()
    try:
        with tracer.span("plan"):
            memo, root, cache_dir = _find(directory, manifest, cache_option)
            plan = _Plan(memo, root, cache_dir, tracer)
            plan.check()
        return plan.run(lock_timeout, t0)
    except (_Miss, KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None  # (a memo of another shape is a miss too)


def _find(
    directory: str, manifest: str | None, cache_option: str | bool | None
) -> tuple[dict[str, Any], str, str]:
    """The memo for this checkout (its manifest, the cache it resolves to), its root and
    cache directory."""
    from epbuild._names import MANIFEST_NAME
    from epbuild.cache.location import resolve

    path = os.path.abspath(os.path.join(directory, manifest or MANIFEST_NAME))
    raw = open_bytes(path)
    if raw is None:
        raise _Miss
    root = os.path.dirname(path)
    value = None if isinstance(cache_option, str) else _manifest_cache(raw)  # --cache wins
    cfg = resolve(
        cache_option,
        base=os.path.abspath(directory),
        manifest_value=value,
        manifest_root=root,
    )
    if cfg is None or cfg.remote is not None:
        raise _Miss
    memo_path = local_path(cfg.local, memo_path_of(path, raw, cfg.local))
    try:
        with open(memo_path, "rb") as f:
            written = os.fstat(f.fileno()).st_mtime_ns
            memo = json.loads(f.read())
    except (OSError, ValueError):
        raise _Miss from None
    if not isinstance(memo, dict) or memo.get("version") != _VERSION or not _tame(memo):
        raise _Miss
    if memo.get("root") not in (None, root):
        raise _Miss  # its ctx models' text holds absolute paths: checked at its path only
    memo["written_ns"] = written
    with contextlib.suppress(OSError):
        os.utime(memo_path)  # its last use: the least recently used go first
    return memo, root, cfg.local


_HEX64 = re.compile(r"[0-9a-f]{64}")
_SLUG = re.compile(r"[0-9a-f]{16}")


def _tame(memo: dict[str, Any]) -> bool:
    """Whether every path and digest in the memo is of the shape the full path writes (a
    cache directory is shared: a memo that points elsewhere is never followed)."""
    out_dir, state_dir = memo["out_dir"], memo["state_dir"]
    if not (is_safe_reference(out_dir) and is_safe_reference(state_dir)):
        return False
    if not all(is_safe_reference(rel) for rel in memo["inputs"]):
        return False
    for a in memo["actions"]:
        if not (_HEX64.fullmatch(a["key"]) and _HEX64.fullmatch(a["entry"])
                and _SLUG.fullmatch(a["slug"])):  # fmt: skip
            return False
        if not a["out_dir"].startswith(out_dir + "/") or not is_safe_reference(a["out_dir"]):
            return False
        for rel, out in a["record"]["outputs"].items():
            if posixpath.dirname(rel) != a["out_dir"] or not _HEX64.fullmatch(out["digest"]):
                return False
    return True


def _manifest_cache(raw: bytes) -> str | None:
    """``[workspace] cache`` of the manifest, as written."""
    from epbuild._names import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Miss from None
    workspace = data.get("workspace")
    value = workspace.get("cache") if isinstance(workspace, dict) else None
    return value if isinstance(value, str) else None


class _Plan:
    """One memo checked against the checkout, then carried out."""

    def __init__(self, memo: dict[str, Any], root: str, cache_dir: str, tracer: Tracer) -> None:
        self.memo = memo
        self.tracer = tracer
        self.root = root
        self.cache = cache_dir
        self.state_dir = os.path.join(root, memo["state_dir"])
        self.journal = os.path.join(self.state_dir, JOURNAL_NAME)
        self.actions: list[dict[str, Any]] = memo["actions"]
        self.inputs: dict[str, Any] = memo["inputs"]
        self.stats: list[tuple[str, os.stat_result, str, list[str] | None]] = []
        """Inputs for the stat cache: path, stat, digest, external-data refs."""
        self.statcache: StatCache | None = None
        self.warnings: list[str] = []
        """What could not be written after the commits (as the full path words it)."""

    def check(self) -> None:
        """Everything planning would read is as recorded, and nothing is there yet."""
        if os.path.lexists(self.journal):
            raise _Miss  # not a fresh checkout: the full path compares with the journal
        written = self.memo["written_ns"]
        for path, stamp in self.memo["stamps"].items():
            if noop.file_stamp(path) != stamp or (stamp and stamp[2] >= written):
                raise _Miss  # changed, or too fresh for its stat to vouch (racy)
        for site, names in self.memo["sites"].items():
            if _distributions(os.getcwd() if site == CWD else site) != names:
                raise _Miss  # a distribution installed, removed, up- or downgraded
        own = frozenset(self.memo["own"])
        for rel, names in self.memo["listings"].items():
            if _listing(self.root, rel, own) != names:
                raise _Miss
        for action in self.actions:
            for rel in action["record"]["outputs"]:
                if os.path.lexists(os.path.join(self.root, rel)):
                    raise _Miss  # the full path replaces them, and says so
            self._entry_holds(action)
        for rel, (digest, refs) in self.inputs.items():  # last: the one costly check
            full = os.path.join(self.root, rel)
            try:
                st = os.stat(full)
                same = digest_file(full).sha256 == digest
                after = os.stat(full)
            except OSError:
                raise _Miss from None
            if not same or (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise _Miss  # other bytes, or written while it was read
            self.stats.append((rel, st, digest, refs))

    def _entry_holds(self, action: dict[str, Any]) -> None:
        """The action's cache entry is the one the memo was made from."""
        path = local_path(self.cache, layout.entry_path(action["key"]))
        try:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != action["entry"]:
                    raise _Miss
        except OSError:
            raise _Miss from None

    def run(self, lock_timeout: float | None, t0: float) -> dict[str, Any]:
        """Under the action and key locks: stage and verify every action's outputs, then,
        under the state lock, commit them all."""
        with ExitStack() as held, self.tracer.slot():
            with self.tracer.span("lock"):
                self._lock(held, lock_timeout)
            staged: list[str] = []
            try:
                for action in self.actions:
                    staged.append(self._stage(action))
                lock = os.path.join(self.state_dir, STATE_LOCK_NAME)
                with locks.hold(lock, "epbuild build (restore)", timeout=lock_timeout):
                    if os.path.lexists(self.journal):
                        raise _Miss  # another build committed meanwhile
                    clean_stale_staging(self.root, self.memo["out_dir"])  # a killed run's
                    times = self._commit(staged)
                    self._finish(self.statcache)
            finally:
                for rel in staged:
                    remove_tree(os.path.join(self.root, rel))
        self._finish(None)
        return self._document(times, time.perf_counter() - t0)

    def _finish(self, statcache: StatCache | None) -> None:
        """What the full path does after its actions (``api._run``): save ``statcache`` and
        sync the journal (under the state lock), or (None) write the trace. Each only saves
        work for later builds: one that cannot write is a warning, never a failure."""
        steps = (
            [("the stat cache was not saved", statcache.save),
             ("the state journal was not synced or compacted",
              lambda: journalfile.sync(self.journal))]
            if statcache is not None
            else [("the trace was not written",
                   lambda: self.tracer.write(os.path.join(self.state_dir, TRACE_NAME)))]
        )  # fmt: skip
        for what, step in steps:
            try:
                step()
            except OSError as exc:
                self.warnings.append(f"{what}: {os_error_text(exc, self.root)}")

    def _lock(self, held: ExitStack, lock_timeout: float | None) -> None:
        """Every action's lock, then every key's (the full path's order: action → key →
        state, which ``run`` takes to commit, the journal still absent under it)."""
        paths = sorted(
            [(os.path.join(self.state_dir, LOCKS_DIR, f"{a['slug']}.lock"),
              f"epbuild build {a['id']}") for a in self.actions]
        )  # fmt: skip
        keys = sorted(
            (local_path(self.cache, layout.key_lock_path(a["key"])),
             f"epbuild build {a['id']} in {self.root}")
            for a in self.actions
        )  # fmt: skip
        for path, what in [*paths, *keys]:
            held.enter_context(locks.hold(path, what, timeout=lock_timeout))

    def _stage(self, action: dict[str, Any]) -> str:
        """Link the action's objects into a fresh staging directory and verify each."""
        self._entry_holds(action)  # again, under its key's lock
        try:
            staging = make_staging(self.root, self.memo["out_dir"], action["slug"])
        except Exception:
            raise _Miss from None
        try:
            for rel, out in action["record"]["outputs"].items():
                dest = os.path.join(self.root, staging, os.path.basename(rel))
                self._place(local_path(self.cache, layout.object_path(out["digest"])), dest, out)
        except BaseException as exc:
            remove_tree(os.path.join(self.root, staging))
            if isinstance(exc, OSError):
                raise _Miss from None
            raise
        return staging

    def _place(self, obj: str, dest: str, out: dict[str, Any]) -> None:
        """``obj`` at ``dest``, verified: a hard link whose stat the cache recorded when it
        last verified the object is taken on trust (``trust``), anything else re-hashed."""
        method = link_or_copy(obj, dest)
        st = os.stat(dest)
        if st.st_size != out["size"]:
            raise _Miss
        if method == "link" and trust.is_trusted(self.cache, out["digest"], st):
            return
        if digest_file(dest).sha256 != out["digest"]:
            raise _Miss  # damaged: the full path discards the entry and says so
        after = os.stat(dest)
        if method == "link" and (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns):
            trust.record(self.cache, out["digest"], st)

    def _commit(self, staged: list[str]) -> list[float]:
        """Commit every staged action (begin → renames → done) and note its entry's use
        (LRU). A failure before the first commit is a miss; after it too, and the full path
        finds what was committed up to date."""
        from epbuild.state.statcache import Entry, StatCache

        stats = self.statcache = StatCache(os.path.join(self.state_dir, STATCACHE_NAME))
        for rel, st, digest, refs in self.stats:
            stats.remember(rel, Entry(st.st_ino, st.st_size, st.st_mtime_ns, digest, _refs(refs)))

        def remember(rel: str, st: os.stat_result, digest: str) -> None:
            stats.remember(rel, Entry(st.st_ino, st.st_size, st.st_mtime_ns, digest))

        times: list[float] = []
        for action, staging in zip(self.actions, staged, strict=True):
            start = self.tracer.now()
            done = {"op": "done", **action["record"], "at": time.time()}
            names = [os.path.basename(r) for r in action["record"]["outputs"]]
            try:
                commit_journaled(self.root, self.journal, (staging, action["out_dir"], names),
                                 [], done, remember, durable=False)  # fmt: skip
            except Exception:
                raise _Miss from None
            self.tracer.add("restore", start, action["id"])
            times.append(self.tracer.now() - start)
            with contextlib.suppress(OSError):  # its last use, for prune (a read-only cache)
                os.utime(local_path(self.cache, layout.entry_path(action["key"])))
        return times

    def _document(self, times: list[float], seconds: float) -> dict[str, Any]:
        """The build's ``--json`` document, as the full path writes it."""
        doc: dict[str, Any] = json.loads(json.dumps(self.memo["document"]))
        for result, took in zip(doc["actions"], times, strict=True):
            result["seconds"] = round(took, 3)
        doc["summary"]["seconds"] = round(seconds, 3)
        doc["warnings"] = self.warnings
        return doc


def _refs(refs: list[str] | None) -> tuple[str, ...] | None:
    return None if refs is None else tuple(refs)


def progress_lines(doc: dict[str, Any]) -> Iterator[str]:
    """What the full path's console reporter says of a restore (stderr)."""
    actions = doc["actions"]
    yield f"epbuild: {len(actions)} of {len(actions)} action(s) to build"
    for i, result in enumerate(actions, 1):
        yield f"[{i}/{len(actions)}] restored {result['id']}"
    for warning in doc["warnings"]:
        yield f"epbuild: warning: {warning}"


# -- writing a memo (the full path) -----------------------------------------------------------


def write_memo(ws: Workspace, plans: list[ActionPlan], cache_dir: str) -> bool:
    """Record the restore memo of a build that left every action of ``plans`` (the whole
    graph) committed and stored in the directory cache ``cache_dir``; returns whether one
    was written (False: not a plain workspace, or something cannot be vouched for)."""
    from epbuild.fs import atomic_write_bytes

    memo = _memo(ws, plans, cache_dir)
    if memo is None:
        return False
    raw = open_bytes(ws.manifest.path)
    if raw is None:
        return False
    path = local_path(cache_dir, memo_path_of(str(ws.manifest.path), raw, cache_dir))
    data = json.dumps(memo, sort_keys=True, separators=(",", ":")).encode()
    if open_bytes(path) != data:
        atomic_write_bytes(path, data, durable=False)  # a torn memo is a miss, never a lie
        _keep_latest(os.path.dirname(path))
    return True


KEPT = 256
"""Memos kept in one cache directory: the most recently used (read or written); the others
are removed as a new one is written (each manifest version, interpreter, machine has its
own)."""


def _keep_latest(folder: str) -> None:
    """Remove all but the ``KEPT`` most recently used memos."""
    try:
        names = [e for e in os.scandir(folder) if e.name.endswith(".json")]
        if len(names) <= KEPT:
            return
        names.sort(key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for old in names[KEPT:]:
            os.unlink(old.path)
    except OSError:
        pass  # another build's cleaning, or a read-only cache: memos are small


def open_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """A file's bytes, None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _plain(ws: Workspace, plans: list[ActionPlan]) -> bool:
    """Whether the memo can stand for planning this workspace: no selection, only compile
    actions of epbuild's own environment and the whole graph planned, no file-valued
    options, no LLMs or quantization recipes, every action committed under its key."""
    from epbuild.planning.actions import Action
    from epbuild.providers import get_provider

    if ws.selectors or ws.manifest.llms or ws.manifest.quantization:
        return False
    if len(plans) != len(ws.graph) or not plans:
        return False
    state = ws.reload_state()
    for plan in plans:
        action = plan.action
        if not isinstance(action, Action) or action.kind != "compile" or plan.key is None:
            return False
        if plan.error is not None:
            return False
        provider = action.provider
        files = get_provider(provider.ep).file_options
        if provider.toolchain is not None or (files and not files.isdisjoint(provider.options)):
            return False
        if plan.key.components.get("compile", {}).get("external_data_folder") is not None:
            return False
        committed = state.records.committed(action.id)
        if committed is None or committed[0] != plan.key.key or action.id in state.interrupted:
            return False
    return True


def _memo(ws: Workspace, plans: list[ActionPlan], cache_dir: str) -> dict[str, Any] | None:
    """The memo's content (None where it cannot vouch)."""

    if not _plain(ws, plans):
        return None
    files: dict[str, list[int] | None] = {}
    dirs: dict[str, list[int] | None] = {}
    if not noop.stamp_sources(ws, files, dirs) or not noop.still_current(ws):
        return None
    if any(_of_the_workspace(ws.root, path) for path in files):
        return None  # a version source in the checkout (a plugin's library): new each time
    settings = ws.manifest.workspace
    own = _own_dirs(ws.root, (settings.out_dir, settings.state_dir, cache_dir))
    cwd = os.getcwd()
    sites = {(CWD if d == cwd else d): _distributions(d) for d in dirs if os.path.isabs(d)}
    listings = {d: _listing(ws.root, d, own) for d in dirs if not os.path.isabs(d)}  # globs
    if None in files.values() or None in sites.values() or None in listings.values():
        return None
    actions = _recorded_actions(ws, plans, cache_dir)
    if actions is None:
        return None
    return {
        "version": _VERSION,
        "root": ws.root if _paths_in_text(actions[0], cache_dir) else None,
        "state_dir": settings.state_dir,
        "out_dir": settings.out_dir,
        "own": sorted(own),
        "stamps": files,
        "sites": sites,
        "listings": listings,
        "inputs": _inputs(ws, plans),
        "actions": actions[0],
        "document": actions[1],
    }


def _of_the_workspace(root: str, path: str) -> bool:
    """Whether ``path`` is a file of the workspace (inside it, not in the interpreter's
    environment, which may sit inside it too)."""
    from epbuild.fs import inside

    return inside(path, root) and not inside(path, sys.prefix)


def _paths_in_text(actions: list[dict[str, Any]], cache_dir: str) -> bool:
    """Whether any ctx model restored holds an absolute path in its free text. If none
    does, no checkout's path can be found there (``onnx.context.path_problems``, which the
    full path's restore runs against the checkout's machine paths, finds nothing anywhere);
    else the memo answers at this workspace's path only."""
    from epbuild.onnx.context import free_text_paths
    from epbuild.onnx.proto import ProtoError, read_model

    for action in actions:
        for rel, out in action["record"]["outputs"].items():
            if not rel.endswith(CTX_SUFFIX):
                continue
            try:
                info = read_model(local_path(cache_dir, layout.object_path(out["digest"])),
                                  strings=True)  # fmt: skip
            except (OSError, ProtoError):
                return True
            if free_text_paths(info):
                return True
    return False


def _inputs(ws: Workspace, plans: list[ActionPlan]) -> dict[str, Any]:
    """Every input's digest and, where the stat cache parsed it, its external-data files."""
    found: dict[str, Any] = {}
    for plan in plans:
        assert plan.key is not None
        for rel, digest in plan.key.inputs.items():
            entry = ws.stats.dirty.get(rel) or ws.stats.entries.get(rel)
            refs = entry.refs if entry is not None and entry.digest == digest else None
            found[rel] = [digest, None if refs is None else list(refs)]
    return found


def _recorded_actions(
    ws: Workspace, plans: list[ActionPlan], cache_dir: str
) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """Each action's entry digest and the record a full restore of it journals, and the
    build document a full restore of them all prints; None if an entry is missing."""
    from dataclasses import replace

    from epbuild.cache.store import CorruptEntryError, parse_entry
    from epbuild.results import BuildResult, Outcome, action_result

    actions: list[dict[str, Any]] = []
    results = []
    for plan in plans:
        action, key = plan.action, plan.key
        assert key is not None
        raw = open_bytes(local_path(cache_dir, layout.entry_path(key.key)))
        if raw is None:
            return None
        try:
            entry = parse_entry(raw, key.key)
        except CorruptEntryError:
            return None
        record = replace(entry.placed(action.out_dir), components=key.components, restored=True)
        data = record.to_json()
        del data["at"]
        actions.append({"id": action.id, "slug": action.slug, "key": key.key,
                        "out_dir": action.out_dir, "entry": hashlib.sha256(raw).hexdigest(),
                        "record": data})  # fmt: skip
        results.append(action_result(action, Outcome.RESTORED, outputs=sorted(record.outputs),
                                     reasons=[NEVER_BUILT]))  # fmt: skip
    return actions, BuildResult(results, 0.0, []).to_json()
