"""Watch mode: rebuild the affected actions whenever their inputs change.

Watchdog observes directories (inotify on Linux, or polling with ``poll=True``); events are
filtered by path to exactly the inputs of the selected actions (models and the external-data
files they reference), the manifest, and files its globs could match -- never the output,
state or cache directories, so epbuild's own writes cannot trigger a build. A burst settles
before anything runs: no relevant event for ``debounce`` seconds and, on inotify, every file
that was being written closed again (a model written slowly in chunks is not compiled
half-done). One build runs at a time, through :func:`epbuild.api.build` and its per-action
locks; changes that arrive during a build coalesce into one follow-up build.
"""

from __future__ import annotations

import os
import posixpath
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from epbuild._names import tomllib
from epbuild.errors import EpbuildError, Interrupted, UserError
from epbuild.results import Reporter

if TYPE_CHECKING:
    from watchdog.events import FileSystemEvent
    from watchdog.observers.api import BaseObserver, ObservedWatch

    from epbuild.executors.local import LocalExecutor
    from epbuild.manifest.load import Manifest
    from epbuild.results import ActionResult, BuildResult


_GLOB_CHARS = re.compile(r"[*?\[]")
_Sig = tuple[int, int, int]
"""(inode, size, mtime_ns) of a file, or None when it does not exist."""


@dataclass
class Cycle:
    """One watch cycle: what changed and what the build did about it."""

    number: int
    changed: list[str]
    """Workspace-relative paths that changed (empty for the first build)."""
    reloaded: bool = False
    """The manifest was re-read and differs from the one before."""
    manifest_error: str | None = None
    """The manifest could not be reloaded; the last good one is still in use."""
    error: str | None = None
    """The build could not start (e.g. a selector no longer matches)."""
    result: BuildResult | None = None
    first_event: float | None = None
    """Wall time of the first event of the burst this cycle answers."""
    started: float = 0.0
    finished: float = 0.0
    action_started: dict[str, float] = field(default_factory=dict)
    """Action id -> wall time its compile started."""

    @property
    def ok(self) -> bool:
        """Nothing failed in this cycle."""
        return (
            not self.manifest_error and not self.error and (self.result is None or self.result.ok)
        )

    def to_json(self) -> dict[str, Any]:
        """One line of ``watch --json``."""
        data: dict[str, Any] = {
            "cycle": self.number,
            "changed": self.changed,
            "manifest_reloaded": self.reloaded,
            "manifest_error": self.manifest_error,
            "error": self.error,
            "first_event": self.first_event,
            "started": self.started,
            "finished": self.finished,
            "action_started": self.action_started,
        }
        if self.result is not None:
            data.update(self.result.to_json())
        else:
            data.update({"summary": None, "actions": [], "warnings": []})
        return data


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + os.sep)


def glob_match(rel: str, pattern: str) -> bool:
    """Does workspace-relative ``rel`` match a manifest glob (``*``, ``?``, ``[..]``, ``**``)?

    Like :func:`glob.glob`, a wildcard does not match a name that starts with a dot, so
    editors' and exporters' hidden temp files never count.
    """

    def match(parts: list[str], pats: list[str]) -> bool:
        if not pats:
            return not parts
        if pats[0] == "**":
            return any(match(parts[i:], pats[1:]) for i in range(len(parts) + 1)) and all(
                not p.startswith(".") for p in parts[: len(parts) - len(pats) + 1]
            )
        if not parts:
            return False
        name, pat = parts[0], pats[0]
        if name.startswith(".") and not pat.startswith(".") and _GLOB_CHARS.search(pat):
            return False
        return fnmatchcase(name, pat) and match(parts[1:], pats[1:])

    return match(rel.split("/"), posixpath.normpath(pattern).split("/"))


def _signature(path: str) -> _Sig | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Targets:
    """What one manifest makes us watch; every path absolute unless said otherwise."""

    root: str
    manifest: str
    files: frozenset[str]
    """Inputs of the selected actions, plus the manifest."""
    patterns: tuple[str, ...]
    """The manifest's model globs (workspace-relative)."""
    excluded: tuple[str, ...]
    """Output, state and cache directories: never a trigger."""
    dirs: frozenset[tuple[str, bool]]
    """(directory, recursive) to observe."""
    inputs: dict[str, frozenset[str]]
    """Action id -> its workspace-relative inputs (models and external data)."""

    def rel(self, path: str) -> str:
        """Workspace-relative POSIX form of an absolute path."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def wants(self, path: str, is_dir: bool) -> bool:
        """Is an event on ``path`` worth waking up for?"""
        if not _under(path, self.root) or any(_under(path, x) for x in self.excluded):
            return False
        if not is_dir:
            return path in self.files or any(glob_match(self.rel(path), p) for p in self.patterns)
        # a directory created, deleted or moved: a watched one (or its parent) came or went,
        # or a recursive glob may now match inside it
        return any(_under(d, path) or (rec and _under(path, d)) for d, rec in self.dirs)


def _raw_patterns(m: Manifest) -> tuple[str, ...]:
    try:
        data = tomllib.loads(m.path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    found: list[str] = []
    for name, table in data.get("groups", {}).items():
        if name in m.groups and isinstance(table, dict):
            found += [
                posixpath.normpath(p) for p in table.get("models", [])
                if isinstance(p, str) and _GLOB_CHARS.search(p)
            ]  # fmt: skip
    return tuple(found)


def _tree(base: str, excluded: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Watches covering ``base`` recursively, leaving the excluded directories out."""
    if any(_under(base, x) for x in excluded):
        return []
    if not any(_under(x, base) for x in excluded):
        return [(base, True)]
    out = [(base, False)]
    try:
        children = [e.path for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
    except OSError:
        children = []
    for child in sorted(children):
        out += _tree(child, excluded)
    return out


def make_targets(
    m: Manifest, selectors: list[str] | tuple[str, ...], previous: Targets | None = None
) -> Targets:
    """Work out the inputs of the selected actions and which directories to observe."""
    from epbuild.state.workspace import open_workspace

    ws = open_workspace(m.root, None, selectors, loaded=m)
    root = str(m.root)
    externals: dict[str, set[str]] = {}
    inputs: dict[str, frozenset[str]] = {}
    for action in ws.actions:
        mine: set[str] = set()
        for model in action.models:
            if model not in externals:
                try:
                    externals[model] = set(ws.keys.model_inputs(model)[1])
                except EpbuildError:  # missing or half-written: keep what we knew
                    old = previous.inputs.get(action.id, frozenset()) if previous else set()
                    externals[model] = {p for p in old if p not in action.models}
            mine |= {model, *externals[model]}
        inputs[action.id] = frozenset(mine)
    manifest = os.path.abspath(m.path)
    files = {manifest} | {os.path.join(root, p) for s in inputs.values() for p in s}
    from epbuild.cache.location import resolve

    wsc = m.workspace
    excluded = [wsc.out_dir, wsc.state_dir]
    cache = resolve(None, base=root, manifest_value=wsc.cache, manifest_root=root)
    if cache is not None:
        excluded.append(cache.local)
    excl = tuple(os.path.normpath(os.path.join(root, x)) for x in excluded)
    dirs: set[tuple[str, bool]] = {(os.path.dirname(f), False) for f in files}
    patterns = _raw_patterns(m)
    for pat in patterns:
        parts = pat.split("/")
        first = next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))
        base = os.path.join(root, *parts[:first]) if first else root
        if first == len(parts) - 1:
            dirs.add((base, False))
        else:
            dirs.update(_tree(base, excl))
    return Targets(root, manifest, frozenset(files), patterns, excl, frozenset(dirs), inputs)


class _Pending:
    """Relevant events collected by the watchdog thread, until the burst settles."""

    def __init__(self, track_writes: bool) -> None:
        self.cond = threading.Condition()
        self.track_writes = track_writes
        self.paths: set[str] = set()
        self.writing: dict[str, float] = {}
        self.last = 0.0
        self.first_wall: float | None = None

    def note(self, path: str, kind: str, is_dir: bool = False) -> None:
        with self.cond:
            now = time.monotonic()
            self.paths.add(path)
            self.last = now
            if self.first_wall is None:
                self.first_wall = time.time()
            if kind in ("created", "modified") and self.track_writes and not is_dir:
                self.writing[path] = now
            elif kind in ("closed", "deleted", "moved_from"):
                self.writing.pop(path, None)
            self.cond.notify_all()

    def add(self, paths: Iterable[str]) -> None:
        """Queue paths found by other means (a watch re-created) for the next cycle."""
        with self.cond:
            self.paths.update(paths)
            self.cond.notify_all()

    def wait(
        self, debounce: float, settle_timeout: float, stop: threading.Event
    ) -> tuple[set[str], float | None] | None:
        """Block until events are pending and settled; None once ``stop`` is set."""
        with self.cond:
            while not stop.is_set():
                now = time.monotonic()
                if not self.paths:
                    self.cond.wait(1.0)
                    continue
                quiet = now - self.last
                open_for = [now - t for p, t in self.writing.items() if p in self.paths]
                open_for = [age for age in open_for if age < settle_timeout]
                if quiet >= debounce and not open_for:
                    taken, first = self.paths, self.first_wall
                    self.paths, self.first_wall = set(), None
                    for p in taken:
                        self.writing.pop(p, None)
                    return taken, first
                delay = debounce - quiet if quiet < debounce else settle_timeout - max(open_for)
                self.cond.wait(min(max(delay, 0.01), 1.0))
            return None


def _make_handler(get_targets: Callable[[], Targets], pending: _Pending, dead: set[str]) -> Any:
    from watchdog.events import FileSystemEventHandler

    class Handler(FileSystemEventHandler):
        def on_any_event(self, event: FileSystemEvent) -> None:
            try:
                self._on(event)
            except Exception:  # never let one odd event stop the watchdog thread
                pending.note(os.fsdecode(event.src_path), "unknown", event.is_directory)

        def _on(self, event: FileSystemEvent) -> None:
            targets = get_targets()
            kind = event.event_type
            src = os.fsdecode(event.src_path)
            dest = os.fsdecode(event.dest_path) if event.dest_path else ""
            if event.is_directory and kind in ("deleted", "moved"):
                dead.add(src)  # a watch on it (if any) is gone with it
            if kind == "moved":
                if src and targets.wants(src, event.is_directory):
                    pending.note(src, "moved_from", event.is_directory)
                if dest and targets.wants(dest, event.is_directory):
                    pending.note(dest, "moved_to", event.is_directory)  # save-by-rename
            elif targets.wants(src, event.is_directory):
                pending.note(src, kind, event.is_directory)

    return Handler()


def _event_filter() -> list[type[FileSystemEvent]]:
    from watchdog import events as ev

    return [
        ev.FileCreatedEvent, ev.FileModifiedEvent, ev.FileDeletedEvent, ev.FileMovedEvent,
        ev.FileClosedEvent, ev.DirCreatedEvent, ev.DirDeletedEvent, ev.DirMovedEvent,
    ]  # fmt: skip


class _Observer:
    """Keeps watchdog's watches in line with the current targets."""

    def __init__(self, poll: bool, interval: float, on_message: Callable[[str], None]) -> None:
        self.poll = poll
        self.interval = interval
        self.on_message = on_message
        self.observer = self._new()
        self.watches: dict[tuple[str, bool], tuple[ObservedWatch, int]] = {}
        self.handler: Any = None
        self.dead: set[str] = set()

    def _new(self) -> BaseObserver:
        if self.poll:
            from watchdog.observers.polling import PollingObserver

            obs: BaseObserver = PollingObserver(timeout=self.interval)
        else:
            from watchdog.observers import Observer

            obs = Observer()
        obs.daemon = True
        obs.start()
        return obs

    def _fall_back(self, exc: OSError) -> None:
        self.on_message(f"cannot watch with inotify ({exc.strerror or exc}); polling instead")
        self.observer.stop()
        self.observer.join()
        self.poll = True
        self.observer = self._new()
        self.watches.clear()

    def reconcile(self, targets: Targets) -> list[str]:
        """Add and drop watches; returns directories newly watched."""
        want: set[tuple[str, bool]] = set()
        for d, rec in targets.dirs:
            while (
                not os.path.isdir(d)
                and _under(os.path.dirname(d), targets.root)
                and (os.path.dirname(d) != d)
            ):
                d, rec = os.path.dirname(d), False  # watch for it to (re)appear
            if os.path.isdir(d):
                want.add((d, rec))
        want -= {(d, False) for d, rec in want if rec}
        dead, self.dead = self.dead, set()
        for key, (watch, ino) in list(self.watches.items()):
            sig = _signature(key[0])
            if key not in want or sig is None or sig[0] != ino or key[0] in dead:
                self.observer.unschedule(watch)
                del self.watches[key]
        added: list[str] = []
        for key in sorted(want - set(self.watches)):
            sig = _signature(key[0])
            if sig is None:
                continue
            try:
                watch = self.observer.schedule(
                    self.handler, key[0], recursive=key[1], event_filter=_event_filter()
                )
            except OSError as exc:
                if self.poll:
                    self.on_message(f"cannot watch {key[0]}: {exc.strerror or exc}")
                    continue
                self._fall_back(exc)
                return self.reconcile(targets)
            self.watches[key] = (watch, sig[0])
            added.append(key[0])
        return added

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=0.5)  # its threads are daemons; do not hold Ctrl-C up


class _CycleReporter(Reporter):
    """Forwards progress to the caller's reporter and notes when each compile started."""

    def __init__(self, inner: Reporter, started: dict[str, float]) -> None:
        self.inner = inner
        self.started = started

    def start(self, total: int, stale: int) -> None:
        self.inner.start(total, stale)

    def action_started(self, action_id: str) -> None:
        self.started[action_id] = time.time()
        self.inner.action_started(action_id)

    def action_finished(self, result: ActionResult) -> None:
        self.inner.action_finished(result)

    def message(self, text: str) -> None:
        self.inner.message(text)


class _Session:
    """The state of one ``watch``: last good manifest, what is watched, file signatures."""

    def __init__(
        self,
        manifest_path: str,
        selectors: list[str] | tuple[str, ...],
        build_kw: dict[str, Any],
        reporter_factory: Callable[[], Reporter],
        on_start: Callable[[Cycle], None],
    ) -> None:
        from epbuild.manifest.load import load_manifest

        self.manifest_path = manifest_path
        self.selectors = selectors
        self.build_kw = build_kw
        self.reporter_factory = reporter_factory
        self.on_start = on_start
        self.broken = False
        self.manifest = load_manifest(manifest_path)
        self.targets = make_targets(self.manifest, selectors)
        self.seen: dict[str, _Sig | None] = {}
        self.number = 0
        self.warm: LocalExecutor | None = None
        """Outlives each build (which does not close an executor passed in): its spare worker,
        already past ``import onnxruntime``, takes the next save's compile at once."""

    def snapshot(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.seen[p] = _signature(p)

    def _reload(self) -> tuple[Manifest | None, str | None]:
        from epbuild.manifest.load import load_manifest
        from epbuild.planning.actions import make_actions, select

        try:
            m = load_manifest(self.manifest_path)
            select(make_actions(m), self.selectors)
        except EpbuildError as exc:
            return None, str(exc)
        return m, None

    def evaluate(self, paths: set[str], first_event: float | None) -> Cycle | None:
        """Decide what a settled burst means; build if needed. None: nothing changed."""
        from epbuild.planning.actions import make_actions, select

        t = self.targets
        changed = {p for p in paths if p in t.files and _signature(p) != self.seen.get(p, ())}
        candidates = {p for p in paths if p not in t.files}
        gone = {p for p in changed if not os.path.exists(p)}
        if any(glob_match(t.rel(p), pat) for p in gone for pat in t.patterns):
            candidates |= gone  # a globbed model went away: it leaves its group
        manifest_changed = t.manifest in changed
        new, error, reloaded = self.manifest, None, False
        if manifest_changed or candidates:
            loaded, error = self._reload()
            if loaded is not None:
                # fixed after an error: say so, and build with it even if it reads the same
                reloaded = loaded != self.manifest or (manifest_changed and self.broken)
                new = loaded
                self.broken = False
            elif manifest_changed:
                self.broken = True
            else:
                error = None  # a glob candidate while the manifest is broken: reported already
        self.snapshot(changed)
        old_models = {m for g in self.manifest.groups.values() for m in g.models}
        new_models = {m for g in new.groups.values() for m in g.models}
        rel = {t.rel(p) for p in changed} | (old_models ^ new_models)
        if manifest_changed and not reloaded and error is None:
            rel.discard(t.rel(t.manifest))  # re-saved with the same meaning
        if not rel and error is None:
            return None
        cycle = Cycle(self.number + 1, sorted(rel), reloaded, error, first_event=first_event)
        self.number += 1
        self.on_start(cycle)
        if reloaded and manifest_changed:
            ids = None  # everything selected: the plan decides what is stale
        else:
            old_actions = {a.id: a for a in select(make_actions(self.manifest), self.selectors)}
            ids = [
                a.id for a in select(make_actions(new), self.selectors)
                if a.id not in old_actions or old_actions[a.id].models != a.models
                or rel & (t.inputs.get(a.id, frozenset()) | set(a.models))
            ]  # fmt: skip
        self.manifest = new
        if ids is None or ids:
            self.run_build(cycle, ids)
        return cycle

    def run_build(self, cycle: Cycle, ids: list[str] | None) -> None:
        """Build the given actions (None: all selected) with the current manifest."""
        from epbuild.api import build

        kw = dict(self.build_kw)
        if self.manifest.workspace.executor == "local":
            if self.warm is None:
                from epbuild.executors.local import LocalExecutor

                self.warm = LocalExecutor(str(self.manifest.root), prewarm=True)
            kw["executor"] = self.warm
        cycle.started = time.time()
        try:
            cycle.result = build(
                self.manifest.root, None, list(self.selectors) if ids is None else ids,
                keep_going=True, loaded=self.manifest,
                reporter=_CycleReporter(self.reporter_factory(), cycle.action_started), **kw,
            )  # fmt: skip
        except Interrupted:
            raise
        except EpbuildError as exc:
            cycle.error = str(exc)
        cycle.finished = time.time()

    def retarget(self, since: float) -> list[str]:
        """Recompute the watched inputs; returns new ones written since ``since`` (they
        changed while we were not yet watching them)."""
        old = self.targets
        try:
            self.targets = make_targets(self.manifest, self.selectors, old)
        except EpbuildError:
            return []
        late: list[str] = []
        for p in sorted(self.targets.files - old.files):
            sig = _signature(p)
            if sig is not None and sig[2] >= since * 1e9:
                self.seen.pop(p, None)
                late.append(p)
            else:
                self.seen[p] = sig
        return late


def watch(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    debounce: float = 0.3,
    jobs: int | None = None,
    lock_timeout: float | None = None,
    poll: bool = False,
    poll_interval: float = 0.5,
    settle_timeout: float = 30.0,
    reporter_factory: Callable[[], Reporter] | None = None,
    on_start: Callable[[Cycle], None] | None = None,
    on_cycle: Callable[[Cycle], None] | None = None,
    on_message: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Build the selected actions, then rebuild the affected ones whenever an input changes.

    Runs until ``stop`` is set or Ctrl-C/SIGTERM (``KeyboardInterrupt``) arrives, which stops
    the workers and releases every lock; returns the number of cycles run. ``on_start`` gets
    each :class:`Cycle` once it knows what changed, before its build; ``on_cycle`` gets
    each :class:`Cycle` (the first one builds everything selected). ``settle_timeout`` caps
    how long a file that is still open for writing holds a build back. ``poll`` uses
    watchdog's polling observer (network file systems, no inotify) every ``poll_interval``
    seconds instead.
    """
    from epbuild.manifest.load import find_manifest

    if debounce < 0:
        raise UserError("--debounce must not be negative")
    on_cycle = on_cycle or (lambda c: None)
    on_start = on_start or (lambda c: None)
    on_message = on_message or (lambda text: None)
    stop = stop or threading.Event()
    path = str(find_manifest(directory, os.fspath(manifest) if manifest else None))
    session = _Session(
        path, selectors, {"jobs": jobs, "lock_timeout": lock_timeout},
        reporter_factory or Reporter, on_start,
    )  # fmt: skip
    pending = _Pending(track_writes=not poll)
    obs = _Observer(poll, poll_interval, on_message)
    obs.handler = _make_handler(lambda: session.targets, pending, obs.dead)
    quiet = debounce + (poll_interval if poll else 0.0)
    try:
        obs.reconcile(session.targets)
        first = Cycle(1, [], started=time.time())
        session.number = 1
        on_start(first)
        session.snapshot(session.targets.files)
        session.run_build(first, None)
        pending.add(session.retarget(first.started))
        obs.reconcile(session.targets)
        on_cycle(first)
        on_message("watching for changes (Ctrl-C to stop)")
        while True:
            got = pending.wait(quiet, settle_timeout, stop)
            if got is None:
                break
            paths, first_event = got
            for d in obs.reconcile(session.targets):  # a watched directory came (back)
                paths |= {f for f in session.targets.files if os.path.dirname(f) == d}
            started = time.time()
            cycle = session.evaluate(paths, first_event)
            if cycle is not None:
                pending.add(session.retarget(cycle.started or started))
            obs.reconcile(session.targets)
            if cycle is not None:
                on_cycle(cycle)
                on_message("watching for changes (Ctrl-C to stop)")
    except (KeyboardInterrupt, Interrupted):
        pass
    finally:
        obs.stop()
        if session.warm is not None:
            session.warm.close()
    return session.number
