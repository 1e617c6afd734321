"""The watch loop: an initial build, then one cycle per settled burst of relevant changes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from epbuild.errors import Interrupted, UserError
from epbuild.manifest.load import find_manifest
from epbuild.results import Reporter
from epbuild.watching.observer import Pending, Watcher, make_handler
from epbuild.watching.session import Cycle, Session


def _first_cycle(session: Session, obs: Watcher, pending: Pending) -> Cycle:
    """Build everything selected, and start watching what it read."""
    obs.reconcile(session.targets)
    first = Cycle(1, [], started=time.time())
    session.number = 1
    session.on_start(first)
    session.snapshot(session.targets.files)
    session.run_build(first, None)
    pending.add(session.retarget(first.started))
    pending.add(os.path.join(session.targets.root, rel) for rel in first.again)
    obs.reconcile(session.targets)
    return first


def _next_cycle(
    session: Session, obs: Watcher, pending: Pending, paths: set[str], first_event: float | None
) -> Cycle | None:
    """Answer one settled burst of events; None when nothing relevant changed."""
    for d in obs.reconcile(session.targets):  # a watched directory came (back)
        paths |= {f for f in session.targets.files if os.path.dirname(f) == d}
    started = time.time()
    cycle = session.evaluate(paths, first_event)
    if cycle is not None:
        pending.add(session.retarget(cycle.started or started))
        pending.add(os.path.join(session.targets.root, rel) for rel in cycle.again)
    obs.reconcile(session.targets)
    return cycle


def watch(
    directory: str | os.PathLike[str] = ".",
    manifest: str | os.PathLike[str] | None = None,
    selectors: list[str] | tuple[str, ...] = (),
    *,
    debounce: float = 0.3,
    jobs: int | None = None,
    lock_timeout: float | None = None,
    cache: str | bool | None = None,
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
    seconds instead. ``lock_timeout`` and ``cache`` are ``build``'s.
    """
    if not debounce >= 0 or debounce == float("inf"):  # NaN compares false
        raise UserError(
            f"--debounce {debounce:g} is not a number of seconds", hint="write e.g. 0.3"
        )
    message = on_message or (lambda text: None)
    path = str(find_manifest(directory, os.fspath(manifest) if manifest else None))
    build_kw = {"jobs": jobs, "lock_timeout": lock_timeout, "cache": cache}
    session = Session(path, selectors, build_kw, reporter_factory or Reporter, on_start)
    pending = Pending(track_writes=not poll)
    obs = Watcher(poll, poll_interval, message)
    obs.handler = make_handler(lambda: session.targets, pending, obs.dead)
    quiet = debounce + (poll_interval if poll else 0.0)
    try:
        cycle: Cycle | None = _first_cycle(session, obs, pending)
        while True:
            if cycle is not None and on_cycle is not None:
                on_cycle(cycle)
            if cycle is not None:
                message("watching for changes (Ctrl-C to stop)")
            got = pending.wait(quiet, settle_timeout, stop or threading.Event())
            if got is None:
                break
            cycle = _next_cycle(session, obs, pending, *got)
    except (KeyboardInterrupt, Interrupted):
        pass
    finally:
        obs.stop()
        if session.warm is not None:
            session.warm.close()
    return session.number
