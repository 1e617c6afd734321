"""The committed reference pages (docs/reference/) are what scripts/gen_reference.py makes
from the code now: a manifest key, option, command, exit code or environment variable
added without regenerating them fails here."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from scriptload import load_script

from epbuild.docsite import SITE_URL

ROOT = Path(__file__).resolve().parent.parent


gen = load_script("scripts/gen_reference.py")
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
        url, _, anchor = text.splitlines()[-1].removeprefix("docs: ").partition("#")
        assert url == SITE_URL + "reference/cli/", title  # the site's page, not a repo path
        if title != "epbuild":
            assert anchor in sections, title
            assert parser.description, f"{title} --help does not say what it does"
            seen += 1
        stack.extend((f"{title} {n}", p) for n, p in gen._subcommands(parser).items())
    assert seen >= 15


def _cli_json(cwd: Path, *args: str) -> tuple[int, dict[str, object]]:
    """``epbuild -C cwd ARGS... --json`` in this process: (exit code, the document)."""
    import contextlib
    import io

    from epbuild.frontends.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["-C", str(cwd), *args, "--json"])
    return rc, json.loads(out.getvalue())


def _named(command: str) -> set[str]:
    """The top-level keys the JSON page names for ``command`` (its first backticked words
    and those after ';' or ':' at the top level)."""
    return set(re.findall(r"`(\w+)`", re.sub(r"\(`[^)]*`\)", "", gen.JSON_KEYS[command])))


FRAME = {"command", "schema_version", "ok", "warnings"}


def test_the_json_page_names_every_key_of_init_add_target_list_and_cache_import(
    tmp_path: Path,
) -> None:
    """What these commands print, checked against their row of the JSON page: each key
    is named there, and a failed import is ``ok: false`` with exit 1 as the row says."""
    import tarfile

    import modelgen

    modelgen.save(modelgen.matmul_model(), tmp_path / "models" / "a.onnx")
    rc, doc = _cli_json(tmp_path, "init", "--from", "models")
    assert rc == 0 and set(doc) - FRAME <= _named("init"), set(doc) - FRAME - _named("init")
    rc, doc = _cli_json(tmp_path, "add", "target", "--list")
    assert rc == 0 and set(doc) - FRAME <= _named("add"), set(doc) - FRAME - _named("add")
    junk = tmp_path / "junk.txt"
    junk.write_text("not a cache file")
    with tarfile.open(tmp_path / "x.tar", "w") as tar:
        tar.add(junk, arcname="junk.txt")
    rc, doc = _cli_json(tmp_path, "cache", "import", str(tmp_path / "x.tar"), "--cache", "c")
    assert set(doc) - FRAME <= _named("cache import"), doc
    assert rc == 1 and doc["ok"] is False and doc["warnings"]
    assert "`ok` is false and the exit status 1" in gen.JSON_KEYS["cache import"]


def _options() -> list[tuple[str, argparse.Action]]:
    """(command, action) of every visible option of every command."""
    found, stack = [], [("epbuild", gen.build_parser())]
    while stack:
        title, parser = stack.pop()
        for action in parser._actions:
            if action.option_strings and action.help not in (None, argparse.SUPPRESS):
                found.append((title, action))
        stack.extend((f"{title} {n}", p) for n, p in gen._subcommands(parser).items())
    return found


def test_every_option_that_takes_a_value_gives_its_default() -> None:
    """In ``--help`` and so in the command reference: an option with a value names its
    default (argparse's, or the help's own "default"), unless it is required."""
    missing = [
        f"{title} {'/'.join(a.option_strings)}"
        for title, a in _options()
        if a.nargs != 0
        and not isinstance(a, argparse._VersionAction)
        and not a.required
        and a.default in (None, [])
        and not re.search(r"default|required", a.help or "")
    ]
    assert missing == []


def test_every_option_with_an_environment_variable_says_so() -> None:
    """Each variable of the environment page that stands for an option (its text names
    ``--option``) is in ``OPTION_ENV``, and every command's row of that option shows it."""
    from epbuild.frontends.parser import OPTION_ENV

    rows = re.findall(r"^\| `(EPBUILD_\w+)` \| (.*) \|$", gen.environment_page(), re.M)
    for name, text in rows:
        for option in re.findall(r"`(--[a-z-]+)`", text):
            assert OPTION_ENV.get(option, "").split("=")[0] == name, (name, option)
    cli = (ROOT / gen.OUT / "cli.md").read_text(encoding="utf-8")
    shown = 0
    for option, env in OPTION_ENV.items():
        lines = [x for x in cli.splitlines() if re.match(rf"\| `{option}[` ]", x)]
        assert lines, option
        for line in lines:
            assert env.split("=")[0] in line, line
            shown += 1
    assert shown >= 10


def test_the_prompt_help_names_the_real_default() -> None:
    from epbuild.frontends.parser import DEFAULT_PROMPT
    from epbuild.llm.generate import DEFAULT_PROMPT as used

    assert used == DEFAULT_PROMPT


def test_schema_prints_the_shipped_schema_and_the_editor_line() -> None:
    """``epbuild schema``: the file the wheel ships (package data), which is the one in
    ``schemas/`` and the code's; ``--json`` adds the line an editor needs."""
    import contextlib
    import io

    from epbuild.frontends.cli import main
    from epbuild.frontends.parser import SCHEMA_LINE
    from epbuild.manifest.schema import schema_text

    shipped = ROOT / "epbuild" / "manifest" / "epbuild.schema.json"
    assert shipped.read_text() == (ROOT / "schemas" / "epbuild.schema.json").read_text()
    assert shipped.read_text() == schema_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"epbuild.manifest" = ["epbuild.schema.json"]' in pyproject  # in the wheel
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["schema"]) == 0
    assert out.getvalue() == shipped.read_text()
    assert (
        SCHEMA_LINE in err.getvalue() and "epbuild schema > epbuild.schema.json" in err.getvalue()
    )
    rc, doc = _cli_json(ROOT, "schema")
    assert rc == 0 and doc["schema"] == json.loads(shipped.read_text())
    assert doc["editor_line"] == SCHEMA_LINE == "#:schema ./epbuild.schema.json"


def test_version_json_prints_the_envelope() -> None:
    import contextlib
    import io

    from epbuild._version import __version__
    from epbuild.frontends.cli import main

    for argv in (["--version", "--json"], ["--json", "--version"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv) == 0
        doc = json.loads(out.getvalue())
        assert doc == {"command": "version", "schema_version": 1, "ok": True,
                       "version": __version__, "warnings": []}  # fmt: skip
