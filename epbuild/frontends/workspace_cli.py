"""``epbuild status`` and ``epbuild clean``: the library's answers about a workspace,
rendered (``render``), or with ``--detail`` what the built outputs hold
(``inspection.detail``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterator

from epbuild.api import clean, status
from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.render import print_json, status_lines


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Run without the cyclic garbage collector: status imports the library and builds a
    large, acyclic picture of the workspace (the journal's records, a key per action) once,
    then exits; every full collection on the way re-scanned all of it (a tenth of ``status``
    at 5,000 actions). Reference counting still frees what is dropped."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def run_status(args: argparse.Namespace) -> int:
    """``epbuild status``: each action up to date or stale and why (``--detail``: what the
    built outputs hold; ``--graph``: the graph as DOT or Mermaid)."""
    if args.graph and (args.detail or args.json):
        raise UserError(
            f"status --graph prints a {args.graph} graph: it takes neither --detail nor --json",
            hint="'status --json' has each action's kind and deps",
        )
    if args.detail and (args.cache or args.no_cache):
        raise UserError(
            "status --detail reads the built outputs, not the cache: --cache and --no-cache "
            "do not apply",
            hint="drop the cache option, or leave out --detail",
        )
    if args.detail:  # what the outputs hold: off plain status's imports
        from epbuild.inspection.detail import render as detail_lines
        from epbuild.inspection.detail import status_detail

        details = status_detail(args.directory, args.manifest, args.selectors)
        if args.json:
            print_json({"actions": [d.to_json() for d in details]}, command="status")
        else:
            print("\n".join(detail_lines(details)))
        return 0
    cache = checks.cache_option(args)
    result = status(args.directory, args.manifest, args.selectors, cache=cache)
    if args.json:
        print_json(result.to_json(), command="status")
    elif args.graph:
        print(render.graph_text(result, args.graph))
    else:
        sys.stdout.write("".join(f"{line}\n" for line in status_lines(result)))
    return 0


def run_clean(args: argparse.Namespace) -> int:
    """``epbuild clean``: the selected actions' outputs and records removed."""
    removed = clean(args.directory, args.manifest, args.selectors, orphaned=args.orphaned)
    if args.json:
        print_json({"removed": list(removed)}, command="clean")
    else:
        print(f"epbuild: removed {len(removed)} file(s)")
    return 0
