"""The committed reference pages (docs/reference/) are what scripts/gen_reference.py makes
from the code now: a manifest key, option, command, exit code or environment variable
added without regenerating them fails here."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()
PAGES = gen.pages()


@pytest.mark.parametrize("name", sorted(gen.pages()))
def test_committed_reference_matches_the_code(name: str) -> None:
    committed = (ROOT / gen.OUT / name).read_text(encoding="utf-8")
    assert committed == PAGES[name], (
        f"docs/reference/{name} is out of date: run python scripts/gen_reference.py"
    )


def test_an_undocumented_schema_key_changes_the_manifest_page(tmp_path: Path) -> None:
    """A key added to (a scratch copy of) the schema shows up as a difference."""
    schema = json.loads((ROOT / "schemas" / "epbuild.schema.json").read_text())
    schema["properties"]["workspace"]["properties"]["brand_new_key"] = {
        "type": "string",
        "description": "A key no page documents yet.",
    }
    scratch = tmp_path / "schema.json"
    scratch.write_text(json.dumps(schema))
    page = gen.pages(scratch)["manifest.md"]
    assert "`brand_new_key`" in page
    assert page != (ROOT / gen.OUT / "manifest.md").read_text(encoding="utf-8")


def test_every_schema_key_and_parser_option_is_on_a_page() -> None:
    """Independent of the generator's formatting: each key's name and each option string."""
    manifest = (ROOT / gen.OUT / "manifest.md").read_text(encoding="utf-8")
    schema = json.loads((ROOT / "schemas" / "epbuild.schema.json").read_text())
    for path, _ in gen.schema_rows(schema):
        key = path.rsplit(".", 1)[-1].removesuffix("[]")
        shown = (f"{key}`", f"{key}]`", f"{key}.<name>]`")
        assert any(s in manifest for s in shown), path
    cli = (ROOT / gen.OUT / "cli.md").read_text(encoding="utf-8")
    stack = [gen.build_parser()]
    while stack:
        parser = stack.pop()
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in cli, option
        stack.extend(gen._subcommands(parser).values())


def test_every_help_says_what_the_command_does_and_ends_with_its_docs_section() -> None:
    cli = (ROOT / gen.OUT / "cli.md").read_text(encoding="utf-8")
    sections = {"-".join(t.split()) for t in re.findall(r"^#+ `(epbuild[^`]*)`", cli, re.M)}
    stack = [("epbuild", gen.build_parser())]
    seen = 0
    while stack:
        title, parser = stack.pop()
        text = parser.format_help().rstrip()
        page, _, anchor = text.splitlines()[-1].removeprefix("docs: ").partition("#")
        assert (ROOT / page).is_file(), title
        if title != "epbuild":
            assert anchor in sections, title
            assert parser.description, f"{title} --help does not say what it does"
            seen += 1
        stack.extend((f"{title} {n}", p) for n, p in gen._subcommands(parser).items())
    assert seen >= 15
