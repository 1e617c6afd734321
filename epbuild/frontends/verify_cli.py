"""``epbuild verify`` and ``epbuild report``: checks of the built outputs
(``inspection.verify``) and the HTML page of a workspace (``inspection.html``), rendered."""

from __future__ import annotations

import argparse

from epbuild._names import GENERATE_TIMEOUT
from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends import render
from epbuild.frontends.render import print_json
from epbuild.inspection.html import write_html_report
from epbuild.inspection.verify import verify_outputs


def run_verify(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.generate:
        raise UserError("--timeout applies to verify --generate only", hint="add --generate")
    limit = checks.timeout(args.timeout, "--timeout", GENERATE_TIMEOUT)
    result = verify_outputs(
        args.directory,
        args.manifest,
        args.selectors,
        load=args.load,
        numerics=args.numerics,
        jobs=args.jobs,
        generate=args.tokens if args.generate else None,
        prompt=args.prompt,
        generate_timeout=limit,
    )
    if args.json:
        print_json(result.to_json(), command="verify", ok=result.ok)
    else:
        print("\n".join(render.verify_lines(result, load=args.load)))
    return 0 if result.ok else 1


def run_report(args: argparse.Namespace) -> int:
    if args.out is None:
        raise UserError(
            "report needs -o/--out FILE: the HTML page to write (formerly --html FILE)",
            hint="epbuild report -o report.html",
        )
    html = checks.output_file(args.out, "-o/--out")
    count = write_html_report(args.directory, args.manifest, args.selectors, html)
    if args.json:
        print_json({"path": html, "actions": count}, command="report")
    else:
        print(f"epbuild: wrote {html} ({count} action(s))")
    return 0
