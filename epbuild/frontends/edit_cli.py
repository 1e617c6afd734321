"""``epbuild init``, ``epbuild add`` and ``epbuild schema``: the manifest edits
(``manifest.init``, ``manifest.edit``) called with the command line's arguments, and what
they did rendered; the manifest's JSON Schema."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from epbuild.errors import UserError
from epbuild.frontends import args as checks
from epbuild.frontends.parser import SCHEMA_LINE
from epbuild.frontends.render import print_json
from epbuild.manifest.schema import shipped_schema

if TYPE_CHECKING:
    from epbuild.manifest.edit import EditResult


def run_init(args: argparse.Namespace) -> int:
    """``epbuild init [--from DIR [--target TARGET]]``."""
    if args.source is None:
        from epbuild.manifest.init import init

        if args.target:
            raise UserError("--target needs --from DIR")
        path = init(args.directory, args.manifest)
        if args.json:
            print_json({"path": path, "groups": [], "skipped": [], "llms": []}, command="init")
        else:
            print(f"epbuild: wrote {path}")
        return 0
    from epbuild.manifest.init import init_from

    result = init_from(args.directory, args.manifest, source=args.source, target=args.target)
    if args.json:
        groups = [
            {"name": g.name, "models": list(g.models), "share_weights": g.share_weights}
            for g in result.groups
        ]
        doc = {"path": result.path, "groups": groups, "skipped": list(result.skipped)}
        doc["llms"] = [{"name": m.name, "source": m.folder} for m in result.llms]
        print_json(doc, command="init")
        return 0
    for line in result.lines():
        print(f"epbuild: {line}")
    return 0


def _list_targets(asked: bool, as_json: bool) -> int:
    from epbuild.providers.qnn import WELL_KNOWN_TARGETS

    if not asked:
        raise UserError("add target needs a TARGET", hint="epbuild add target --list")
    if as_json:
        targets = [
            {"name": n, "title": t.title, "htp_arch": t.htp_arch, "soc_model": t.soc_model}
            for n, t in WELL_KNOWN_TARGETS.items()
        ]
        print_json({"targets": targets}, command="add")
        return 0
    for name, t in WELL_KNOWN_TARGETS.items():
        print(f"{name:<26} {t.title}: htp_arch {t.htp_arch}, soc_model {t.soc_model}")
    print("(part numbers work too: epbuild add target sm8650)")
    return 0


def _toolchain(args: argparse.Namespace) -> dict[str, Any] | None:
    """``add provider``'s ``--requirement`` or ``--python`` as a manifest ``toolchain``."""
    if args.requirement:
        return {"requirements": args.requirement}
    return {"python": args.python} if args.python is not None else None


def _edit(args: argparse.Namespace) -> EditResult:
    from epbuild.manifest import edit

    where = (args.directory, args.manifest)
    if args.add_command == "model":
        return edit.add_models(
            *where,
            models=args.paths,
            group=args.group,
            providers=args.provider,
            share_weights=bool(args.share_weights),
            quantize=args.quantize,
        )
    if args.add_command == "llm":
        from epbuild.manifest.edit_llm import add_llm

        return add_llm(
            *where,
            name=args.name,
            source=args.source,
            providers=args.provider,
            context_length=args.context_length,
            window_size=args.window_size,
            share_weights=args.share_weights,
        )
    if args.add_command == "quantization":
        from epbuild.manifest.edit_quant import add_quantization

        return add_quantization(
            *where,
            name=args.name,
            calibration=args.calibration or (),
            validation=args.validation or (),
            activations=args.activations,
            weights=args.weights,
            per_channel=args.per_channel,
            method=args.method,
            exclude=args.exclude or (),
        )
    options = checks.provider_options(args.option)
    if args.add_command == "provider":
        return edit.add_provider(
            *where,
            name=args.name,
            ep=args.ep,
            options=options,
            replace=args.replace,
            toolchain=_toolchain(args),
        )
    return edit.add_target(
        *where,
        target=args.target,
        ep=args.ep,
        options=options,
        to=args.group,
        name=args.provider,
        replace=args.replace,
    )


def run_add(args: argparse.Namespace) -> int:
    """``epbuild add model|provider|target|llm``."""
    if args.add_command == "target" and (args.list or args.target is None):
        return _list_targets(args.list, args.json)
    result = _edit(args)
    if args.json:
        doc = {
            "path": result.path,
            "written": result.written,
            "changes": list(result.changes),
            "notes": list(result.notes),
        }
        print_json(doc, command="add")
        return 0
    for line in (*result.changes, *result.notes):
        print(f"epbuild: {line}")
    print(f"epbuild: wrote {result.path}" if result.written else "epbuild: nothing to change")
    return 0


def run_schema(args: argparse.Namespace) -> int:
    """The manifest's JSON Schema on stdout (the file the wheel ships, which is the one in
    ``schemas/``); how to use it on stderr, or both in one document under ``--json``."""
    text = shipped_schema()
    if args.json:
        print_json({"schema": json.loads(text), "editor_line": SCHEMA_LINE}, command="schema")
        return 0
    sys.stdout.write(text)
    print(
        "epbuild: save it beside the manifest (epbuild schema > epbuild.schema.json) and make "
        f"this the manifest's first line: {SCHEMA_LINE}",
        file=sys.stderr,
    )
    return 0
