"""``epbuild watch``: the library's watch loop (``watching``), its cycles rendered."""

from __future__ import annotations

import argparse
import functools

from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.progress import ConsoleReporter
from epbuild.watching import watch


def run_watch(args: argparse.Namespace) -> int:
    """``epbuild watch``: the library's watch loop, its cycles rendered; ends on Ctrl-C."""
    watch(
        args.directory,
        args.manifest,
        args.selectors,
        debounce=args.debounce,
        jobs=checks.check_jobs(args.jobs),
        lock_timeout=checks.seconds(args.lock_timeout, "--lock-timeout"),
        cache=checks.cache_option(args),
        poll=args.poll,
        reporter_factory=ConsoleReporter,
        on_start=functools.partial(render.watch_started, args.json),
        on_cycle=functools.partial(render.watch_finished, args.json),
        on_message=render.watch_message,
    )
    return 0
