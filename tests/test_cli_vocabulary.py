"""One vocabulary across the command line: a concept is spelled the same way in every
command that takes it, and a former spelling still works, hidden, with a deprecation note.

The tables below are the vocabulary; the tests walk the real parser (every command and
sub-command), so a new option that spells a known concept another way fails here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from modelgen import matmul_model, save

from epbuild.frontends import cli
from epbuild.frontends.parser import build_parser

VOCABULARY: dict[str, tuple[tuple[str, ...], set[str | None]]] = {
    # concept (the dest commands read): (option strings, metavars allowed)
    "group": (("-g", "--group"), {"GROUP"}),
    "provider": (("-p", "--provider"), {"NAME"}),
    "out": (("-o", "--out"), {"DIR", "FILE"}),
    "jobs": (("-j", "--jobs"), {"N"}),
    "keep_going": (("-k", "--keep-going"), {None}),
    "json": (("--json",), {None}),
    "cache": (("--cache",), {"DIR|URL"}),
    "no_cache": (("--no-cache",), {None}),
    "lock_timeout": (("--lock-timeout",), {"SECONDS"}),
    "option": (("--option",), {"KEY=VALUE"}),
    "replace": (("--replace",), {None}),
    "target": (("--target",), {"TARGET"}),
    "directory": (("-C",), {"DIR"}),
    "manifest": (("-f", "--file"), {"FILE"}),
}
"""Each concept's one spelling (``-o`` names a directory or a file by what is written)."""

RENAMED = {
    ("add", "target"): {"--to": "group", "--name": "provider"},
    ("report",): {"--html": "out"},
}
"""Former spellings, kept working: (command) → {option: the concept it now spells}."""

SAME_THING_ELSEWHERE = {"--to", "--name", "--html", "--output", "--dir", "--outdir"}
"""Spellings no visible option may use (another word for a concept above)."""


def parsers() -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command words, parser) for the top level and every (sub-)command."""
    todo: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = [((), build_parser())]
    while todo:
        words, p = todo.pop()
        yield words, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [((*words, n), sub) for n, sub in action.choices.items()]


def visible_options(p: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in p._actions:
        hidden = action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction)
        if action.option_strings and not hidden:
            yield action


def test_every_concept_is_spelled_one_way() -> None:
    wrong = []
    for words, p in parsers():
        for action in visible_options(p):
            if action.dest in VOCABULARY:
                strings, metavars = VOCABULARY[action.dest]
                if tuple(action.option_strings) != strings or action.metavar not in metavars:
                    shown = f"{'/'.join(action.option_strings)} {action.metavar}"
                    wrong.append(f"epbuild {' '.join(words)}: {action.dest} as {shown}")
    assert not wrong, "\n".join(wrong)


def test_no_two_commands_spell_the_same_option_differently() -> None:
    """Across commands: one dest, one set of option strings; one option string, one dest."""
    by_dest: dict[str, set[tuple[str, ...]]] = {}
    by_string: dict[str, set[str]] = {}
    for _, p in parsers():
        for action in visible_options(p):
            by_dest.setdefault(action.dest, set()).add(tuple(action.option_strings))
            for s in action.option_strings:
                by_string.setdefault(s, set()).add(action.dest)
    assert {d: s for d, s in by_dest.items() if len(s) > 1} == {}
    assert {o: d for o, d in by_string.items() if len(d) > 1} == {}
    assert not SAME_THING_ELSEWHERE & by_string.keys()


def test_commands_that_change_something_take_json() -> None:
    takes = {" ".join(w) for w, p in parsers() if any(a.dest == "json" for a in p._actions)}
    leaves = {" ".join(w) for w, p in parsers() if not any(
        isinstance(a, argparse._SubParsersAction) for a in p._actions
    )}  # fmt: skip
    assert leaves - takes == set()


def test_renamed_options_are_hidden_and_parse_as_the_new_ones() -> None:
    found = {}
    for words, p in parsers():
        for action in p._actions:
            if action.help is argparse.SUPPRESS and action.option_strings:
                found.setdefault(words, {})[action.option_strings[0]] = action.dest
    assert found == RENAMED
    parser = build_parser()
    args = parser.parse_args(["add", "target", "x", "--to", "a", "-g", "b", "--name", "n"])
    assert args.group == ["a", "b"] and args.provider == "n"
    assert len(args.deprecated) == 2 and all("deprecated" in n for n in args.deprecated)
    args = parser.parse_args(["report", "--html", "r.html"])
    assert args.out == "r.html" and args.deprecated == ["--html is deprecated: write -o/--out "
                                                        "(it does the same)"]  # fmt: skip


@pytest.fixture
def root(tmp_path: Path) -> Path:
    save(matmul_model(1, n=8), tmp_path / "models" / "a.onnx")
    (tmp_path / "epbuild.toml").write_text(
        '[providers.htp]\nep = "qnn"\noptions = { htp_arch = "73", soc_model = "60" }\n\n'
        '[groups.main]\nmodels = ["models/a.onnx"]\nproviders = ["htp"]\n'
    )
    return tmp_path


def run(root: Path, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["-C", str(root), *argv])
    return rc, out.getvalue(), err.getvalue()


def test_a_former_spelling_works_and_says_so_once(root: Path) -> None:
    rc, out, err = run(root, "add", "target", "snapdragon-8-gen-3", "--to", "main")
    assert rc == 0 and "wrote" in out, err
    assert err.strip().splitlines()[-1] == (
        "epbuild: warning: --to is deprecated: write -g/--group (it does the same)"
    )
    rc, out, err = run(root, "add", "target", "v79", "--ep", "qnn", "--option", "htp_arch=79",
                       "--option", "soc_model=69", "--name", "v79b", "--json")  # fmt: skip
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and "warning" not in err
    assert doc["warnings"] == [{"severity": "warning", "message": "--name is deprecated: "
                                "write -p/--provider (it does the same)"}]  # fmt: skip
    assert "[providers.v79b]" in (root / "epbuild.toml").read_text()
    rc, _, err = run(root, "add", "target", "snapdragon-8-elite", "--to", "nogroup")
    assert rc == 2 and err.count("\n") <= 2 and "deprecated" not in err  # one message


def test_version() -> None:
    """``epbuild --version`` says the version, as every command-line tool does."""
    import subprocess
    import sys

    import epbuild

    proc = subprocess.run([sys.executable, "-m", "epbuild", "--version"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == f"epbuild {epbuild.__version__}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["build"], ["-C", "ws", "build", "-j", "2", "--cache-only", "--cache", "c", "a/b"],
        ["-Cws", "--debug", "-f", "m.toml", "status", "--json"], ["--file=m.toml", "clean"],
        ["-C", "status", "build"], ["build", "--no-such-option"], ["status", "--graph", "x"],
        ["cache", "key", "g"], ["cache"], ["add", "target", "x", "--to", "g"],
        ["report", "--html", "r.html"], ["--fi", "m.toml", "build"], ["nope"], [],
        ["-h"], ["build", "--help"], ["--debug"], ["-C"], ["lock", "--check"],
    ],
)  # fmt: skip
def test_the_parser_made_for_one_command_parses_alike(argv: list[str]) -> None:
    """``main`` makes only the sub-parser of the command it was given: every command line
    parses to the same namespace, or fails with the same message, as with the whole
    parser."""

    def parse(parser: argparse.ArgumentParser) -> tuple[str, object]:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                return "ok", vars(parser.parse_args(argv))
        except SystemExit as exc:
            return "exit", (exc.code, out.getvalue())
        except Exception as exc:
            return type(exc).__name__, (str(exc), getattr(exc, "usage", None))

    whole = parse(build_parser(raise_usage_errors=True))
    assert parse(build_parser(raise_usage_errors=True, argv=argv)) == whole
