"""``epbuild package``: the library's ``shipping.package`` with the command line's options,
its result rendered."""

from __future__ import annotations

import argparse

from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.progress import ConsoleReporter
from epbuild.frontends.render import print_json
from epbuild.shipping.package import package


def run_package(args: argparse.Namespace) -> int:
    # With --json, only notes (a lock waited for) reach stderr.
    reporter = ConsoleReporter(quiet=args.json)
    build_options = {
        "jobs": checks.check_jobs(args.jobs),
        "keep_going": args.keep_going,
        "cache": checks.cache_option(args),
    }
    if not args.build and (args.jobs or args.keep_going or args.cache or args.no_cache):
        raise UserError("-j, -k and the cache flags apply to package --build only")
    result = package(
        args.directory,
        args.manifest,
        args.selectors,
        args.out,
        build=args.build,
        check="hash" if args.hash else "stat",
        reporter=reporter,
        build_options=build_options,
        lock_timeout=checks.seconds(args.lock_timeout, "--lock-timeout"),
        force=args.force,
    )
    if args.json:
        print_json(result.to_json(), command="package")
    else:
        print("\n".join(render.package_lines(result)))
    return 0
