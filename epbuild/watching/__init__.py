"""Watch mode: rebuild the affected actions whenever their inputs change.

Watchdog observes directories (inotify on Linux, or polling with ``poll=True``); events are
filtered by path to exactly the inputs of the selected actions (models and the external-data
files they reference), the manifest, and files its globs could match -- never the output,
state or cache directories, so epbuild's own writes cannot trigger a build. A burst settles
before anything runs: no relevant event for ``debounce`` seconds and, on inotify, every file
that was being written closed again (a model written slowly in chunks is not compiled
half-done). One build runs at a time, through :func:`epbuild.api.build` and its per-action
locks; changes that arrive during a build coalesce into one follow-up build.

Modules: ``targets`` (what to watch), ``observer`` (watchdog events and watches),
``session`` (what a burst means, and its build), ``loop`` (:func:`watch`). Never on the
no-op path, so this package may import its modules eagerly.
"""

from __future__ import annotations

from epbuild.watching.loop import watch
from epbuild.watching.session import Cycle
from epbuild.watching.targets import Targets, glob_match, make_targets

__all__ = ["Cycle", "Targets", "glob_match", "make_targets", "watch"]
