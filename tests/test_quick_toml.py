"""``epbuild._toml.read`` answers what ``tomllib.loads`` does, or leaves the text to it:
on every manifest in the repository, on cases at the edges of what it reads, and on texts
made at random from TOML's pieces, valid or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epbuild._names import tomllib
from epbuild._toml import read

ROOT = Path(__file__).resolve().parent.parent


def same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (``True == 1`` does not count) and the
    same order of keys."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def check(text: str) -> dict[str, Any] | None:
    """``read(text)``, after checking it against tomllib: None where tomllib refuses."""
    got = read(text)
    try:
        want = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):
        assert got is None, text
        return None
    assert got is None or same(got, want), text
    return got


def test_every_manifest_in_the_repository() -> None:
    texts = [p.read_text() for p in sorted(ROOT.glob("**/*.toml")) if ".venv" not in p.parts]
    assert texts
    read_here = [t for t in texts if check(t) is not None]
    assert len(read_here) >= len(texts) // 2  # most are plain


READ = [
    "",
    "\n\n# only a comment\n",
    'a = "x"',
    "a = \"x\"\nb = 'y' # comment\n",
    "a = 1\nb = -2\nc = +3\nd = 0\ne = true\nf = false\n",
    'a = ["x", "y",]\nb = [\n  1,  # one\n  2,\n]\nc = []\nd = [[1], ["x"]]\n',
    'o = { a = "1", b = 2, c = { d = true }, e = [] }\np = {}\n',
    '[a]\nx = 1\n[a.b]\ny = "#"\n[ c . d ]\n',
    "[a.b]\nx = 1\n[a]\ny = 2\n",
    "[a.b.c]\n[a.b]\n[a]\n",
    'a = "tab\tinside"\nb = "é ü ✓"\n',
    "key-with_dash-1 = 1\n1234 = 2\n",
    '"a" = 1\n\'b c\' = 2\n"" = 3\n[ "t" . \'u.v\' ]\no = { "k" = "v", \'l\' = 1 }\n',
]
LEFT_TO_TOMLLIB = [
    'a = "x\\ty"',
    'a = """x"""',
    "a = '''x'''",
    "a = 1.5",
    "a = 1e3",
    "a = 1_000",
    "a = 0x1f",
    "a = 1979-05-27",
    "a = 07:32:00",
    "a = inf",
    'a.b = "x"',
    '"a\\u0041" = 1',
    '"a" = 1\na = 2\n',
    "[[a]]\nx = 1\n",
    'a = "x"\r\n',
    "a = { b = 1,\n c = 2 }",
    # errors: tomllib says what is wrong
    "a = 1\na = 2\n",
    "[a]\n[a]\n",
    "[a]\nb = 1\n[a.b]\n",
    "a = { b = 1 }\n[a.c]\n",
    "[a.b]\n[a]\nb = 1\n",
    "a = 01",
    "a = +",
    "a = trueish",
    "a = ",
    'a = "x" b = 1',
    "a = [1 2]",
    "a = [,]",
    "a = { b = 1, }",
    'a = "unclosed',
    "a = [1,",
    "[a",
    "a = 1 # \x01",
    "a = '\x7f'",
]


@pytest.mark.parametrize("text", READ)
def test_what_it_reads(text: str) -> None:
    assert check(text) is not None, text


@pytest.mark.parametrize("text", LEFT_TO_TOMLLIB)
def test_what_it_leaves_to_tomllib(text: str) -> None:
    assert read(text) is None
    check(text)


PIECES = [
    *("a", "b", "c-d", "1", '"q"', " ", "\t", "=", " = ", ".", ",", "[", "]", "[[", "]]"),
    *("{", "}", "\n", "# c\n", '"s"', "'l'", '"""', '"\\n"', "-2", "+3", "01", "1.5", "1_0"),
    *("true", "false", "tru", "[a]\n", "[a.b]\n", "x = 1\n", "x = [1, 2]\n", "x = {y = 1}\n"),
    *("\r\n", "\x00", "é", "''", '""'),
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=24))
def test_random_texts(pieces: list[str]) -> None:
    check("".join(pieces))
