"""``read``: the TOML most manifests are written in, read without ``tomllib``, whose import
compiles three regular expressions (with ``datetime``, a tenth of a restore, and of a
no-op build).

It reads tables (``[a.b]``), ``key = value`` lines with bare or quoted keys (not dotted),
and values that are strings without escapes, decimal integers, booleans, arrays and
one-line inline tables, with comments and blank lines between. It answers
``tomllib.loads(text)`` or ``None``: anything else, and anything that might be an error (a
key or table defined twice, a control character), is left to ``tomllib``, which reads it or
says what is wrong.
"""

from __future__ import annotations

from typing import Any

_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_DIGITS = frozenset("0123456789")
_AFTER_VALUE = frozenset(" \t,]}#\n")


class _Unsure(Exception):
    """Outside what is read here, or not valid TOML: ``tomllib`` decides."""


def read(text: str) -> dict[str, Any] | None:
    """``tomllib.loads(text)`` if ``text`` is in the subset read here, else None."""
    if "\r" in text or not text.replace("\t", "").replace("\n", "").isprintable():
        return None  # control characters (TOML refuses most) and CRLF: tomllib's
    try:
        return _Reader(text).document()
    except (_Unsure, IndexError, RecursionError):  # IndexError: it ended inside a value
        return None


class _Reader:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.root: dict[str, Any] = {}
        self.defined: set[tuple[str, ...]] = set()  # tables with a header of their own
        self.implied: set[tuple[str, ...]] = set()  # tables a longer header made
        self.values: set[tuple[str, ...]] = set()  # keys given a value by a line

    def document(self) -> dict[str, Any]:
        table = self.root
        path: tuple[str, ...] = ()
        while True:
            self.blank_lines()
            if self.i >= len(self.s):
                return self.root
            if self.s[self.i] == "[":
                path = self.header()
                table = self.table(path)
            else:
                key = self.key()
                self.expect("=")
                if key in table:
                    raise _Unsure
                table[key] = self.value()
                self.values.add((*path, key))
            self.line_end()

    def header(self) -> tuple[str, ...]:
        self.i += 1
        if self.s[self.i] == "[":
            raise _Unsure  # an array of tables
        keys = [self.key()]
        self.spaces()
        while self.s[self.i] == ".":
            self.i += 1
            keys.append(self.key())
            self.spaces()
        self.expect("]")
        return tuple(keys)

    def table(self, path: tuple[str, ...]) -> dict[str, Any]:
        """The table a header opens, made with the tables above it that do not exist yet."""
        if path in self.defined:
            raise _Unsure
        node = self.root
        for depth in range(1, len(path) + 1):
            prefix, key = path[:depth], path[depth - 1]
            if prefix in self.values:
                raise _Unsure  # under a value (an inline table, a string...)
            found = node.get(key)
            if found is None:
                found = node[key] = {}
                if depth < len(path):
                    self.implied.add(prefix)
            elif not isinstance(found, dict) or (depth == len(path) and prefix not in self.implied):
                raise _Unsure
            node = found
        self.defined.add(path)
        return node

    def key(self) -> str:
        self.spaces()
        if self.s[self.i] in "\"'":
            return self.string()  # a quoted key
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in _BARE:
            self.i += 1
        if self.i == start:
            raise _Unsure
        return self.s[start : self.i]

    def string(self) -> str:
        """A one-line string without escapes (basic or literal)."""
        s, i = self.s, self.i
        c = s[i]
        end = s.find(c, i + 1)
        body = s[i + 1 : end]
        if end < 0 or (end == i + 1 and s.startswith(c * 3, i)) or "\n" in body:
            raise _Unsure  # unclosed, or multi-line
        if c == '"' and "\\" in body:
            raise _Unsure  # escapes
        self.i = end + 1
        return body

    def value(self) -> Any:
        self.spaces()
        s, i = self.s, self.i
        c = s[i]
        if c in "\"'":
            return self.string()
        if c == "[":
            return self.array()
        if c == "{":
            return self.inline_table()
        for word, value in (("true", True), ("false", False)):
            if s.startswith(word, i):
                self.i = i + len(word)
                self.ended()
                return value
        if c in "+-" or c in _DIGITS:
            j = i + 1 if c in "+-" else i
            k = j
            while k < len(s) and s[k] in _DIGITS:
                k += 1
            if k == j or (s[j] == "0" and k > j + 1):
                raise _Unsure  # no digits, or a leading zero
            self.i = k
            self.ended()  # not a float, a date, a time, 1_000, 0x1f...
            return int(s[i:k])
        raise _Unsure  # inf, nan, ...

    def ended(self) -> None:
        if self.i < len(self.s) and self.s[self.i] not in _AFTER_VALUE:
            raise _Unsure

    def array(self) -> list[Any]:
        self.i += 1
        out: list[Any] = []
        while True:
            self.blank_lines()
            if self.s[self.i] == "]":
                self.i += 1
                return out
            out.append(self.value())
            self.blank_lines()
            if self.s[self.i] == ",":
                self.i += 1
            elif self.s[self.i] == "]":
                self.i += 1
                return out
            else:
                raise _Unsure

    def inline_table(self) -> dict[str, Any]:
        self.i += 1
        out: dict[str, Any] = {}
        self.spaces()
        if self.s[self.i] == "}":
            self.i += 1
            return out
        while True:
            key = self.key()
            self.expect("=")
            if key in out:
                raise _Unsure
            out[key] = self.value()
            self.spaces()
            if self.s[self.i] == ",":
                self.i += 1
            elif self.s[self.i] == "}":
                self.i += 1
                return out
            else:
                raise _Unsure

    def spaces(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1

    def blank_lines(self) -> None:
        """Spaces, comments and line ends."""
        while True:
            self.spaces()
            if self.i < len(self.s) and self.s[self.i] == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            if self.i < len(self.s) and self.s[self.i] == "\n":
                self.i += 1
            else:
                return

    def expect(self, char: str) -> None:
        self.spaces()
        if self.s[self.i] != char:
            raise _Unsure
        self.i += 1

    def line_end(self) -> None:
        self.spaces()
        if self.i < len(self.s) and self.s[self.i] == "#":
            end = self.s.find("\n", self.i)
            self.i = len(self.s) if end < 0 else end
        if self.i < len(self.s):
            if self.s[self.i] != "\n":
                raise _Unsure
            self.i += 1
