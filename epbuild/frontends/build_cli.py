"""``epbuild build``: arguments checked into the API's keywords, the no-op fast path first,
then the build (and ``--numerics``).

The no-op fast path runs here: the API and the reporter load only when it does not answer
(they are most of a full build's imports), the numerical checks only for ``--numerics``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.render import print_json, summary_line


def _build_options(args: argparse.Namespace) -> dict[str, Any]:
    """``build``'s keyword arguments to the API, every argument checked."""
    return {
        "jobs": checks.check_jobs(args.jobs),
        "keep_going": args.keep_going,
        "dry_run": args.dry_run,
        "lock_timeout": checks.seconds(args.lock_timeout, "--lock-timeout"),
        "cache": checks.cache_option(args),
        "cache_only": args.cache_only,
        "cache_push": args.cache_push,
        "memory_budget": checks.memory_budget(args.memory_budget),
        "trace": args.trace,
        "executor": args.executor,
        "scheduler": checks.scheduler(args.scheduler),
        "locked": _locked(args),
    }


def _locked(args: argparse.Namespace) -> bool:
    """``--locked``, or ``EPBUILD_LOCKED=1`` (for CI); read here, off the no-op path's
    imports."""
    value = os.environ.get("EPBUILD_LOCKED", "").strip().lower()
    return bool(args.locked) or value in ("1", "true", "yes")


def _answered_by_noop(args: argparse.Namespace) -> bool:
    """Print the recorded result if nothing changed since an all-up-to-date build (``noop``).
    Not with ``--cache DIR``: the full path stores the up-to-date actions that DIR lacks."""
    if args.dry_run or args.trace or _locked(args) or args.cache is not None or args.numerics:
        return False  # --locked compares the environments with the lock: the full path;
        # the fingerprint is of the graph without the numerical checks
    from epbuild.planning.noop import fast_noop  # not for a build that skips it (--cache)

    t0 = time.perf_counter()
    doc = fast_noop(args.directory, args.manifest, args.selectors)
    if doc is None:
        return False
    doc["summary"]["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print_json(doc, command="build")
    else:
        print(summary_line(doc["summary"]))
    return True


def run_build(args: argparse.Namespace) -> int:
    """``epbuild build``; returns the exit code."""
    options = _build_options(args)  # before the fast path: a bad argument is always exit 2
    if _answered_by_noop(args):
        return 0
    from epbuild.api import build
    from epbuild.frontends.progress import ConsoleReporter

    result = build(
        args.directory,
        args.manifest,
        args.selectors,
        reporter=ConsoleReporter(),
        numerics=args.numerics,
        **options,
    )
    if not args.numerics:
        if args.json:
            print_json(result.to_json(), command="build", ok=result.exit_code == 0)
        else:
            print("\n".join(render.build_lines(result)))
        return result.exit_code
    from epbuild.inspection.numerics import build_verdicts
    from epbuild.results import CheckStatus

    numerics = build_verdicts(args.directory, args.manifest, result)
    failed = any(c.status is CheckStatus.FAILED for c in numerics)
    code = result.exit_code or (1 if failed else 0)
    if args.json:
        doc = {**result.to_json(), "numerics": [c.to_json() for c in numerics]}
        print_json(doc, command="build", ok=code == 0)
    else:
        print("\n".join([*render.build_lines(result), *(c.line() for c in numerics)]))
    return code
