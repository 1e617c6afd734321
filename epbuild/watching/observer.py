"""Watchdog's side of watch: collect relevant events until a burst settles, and keep the
observed directories in line with the targets (falling back to polling without inotify)."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from epbuild.watching.targets import Targets, signature, under

if TYPE_CHECKING:
    from watchdog.events import FileSystemEvent
    from watchdog.observers.api import BaseObserver, ObservedWatch


class Pending:
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


def make_handler(get_targets: Callable[[], Targets], pending: Pending, dead: set[str]) -> Any:
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
            what = "moved_from" if kind == "moved" else kind
            if what == "created" and not event.is_directory and _arrived_whole(src):
                what = "moved_to"  # no close will follow: nothing is being written
            for path in targets.names(src) if src else ():  # a symlink's target: the link
                if targets.wants(path, event.is_directory):
                    pending.note(path, what, event.is_directory)
            for path in targets.names(dest) if dest and kind == "moved" else ():
                if targets.wants(path, event.is_directory):
                    pending.note(path, "moved_to", event.is_directory)  # save-by-rename

    return Handler()


def _arrived_whole(path: str) -> bool:
    """Whether a created file came whole (moved in from an unwatched folder, a new hard link
    or symlink: inotify sends no close for those) rather than being opened for writing, which
    leaves it empty at first (a write already begun sends its own modified events)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False  # gone again: its deleted event follows
    return not stat.S_ISREG(st.st_mode) or st.st_size > 0


def _event_filter() -> list[type[FileSystemEvent]]:
    from watchdog import events as ev

    return [
        ev.FileCreatedEvent,
        ev.FileModifiedEvent,
        ev.FileDeletedEvent,
        ev.FileMovedEvent,
        ev.FileClosedEvent,
        ev.DirCreatedEvent,
        ev.DirDeletedEvent,
        ev.DirMovedEvent,
    ]


class Watcher:
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
                and under(os.path.dirname(d), targets.root)
                and (os.path.dirname(d) != d)
            ):
                d, rec = os.path.dirname(d), False  # watch for it to (re)appear
            if os.path.isdir(d):
                want.add((d, rec))
        want -= {(d, False) for d, rec in want if rec}
        dead, self.dead = self.dead, set()
        for key, (watch, ino) in list(self.watches.items()):
            sig = signature(key[0])
            if key not in want or sig is None or sig[0] != ino or key[0] in dead:
                self.observer.unschedule(watch)
                del self.watches[key]
        added: list[str] = []
        for key in sorted(want - set(self.watches)):
            sig = signature(key[0])
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
