"""Where a key sits in the manifest text: tomllib reports no positions, so every error
message that names a line finds it here."""

from __future__ import annotations

import re
from pathlib import Path

from epbuild.errors import ManifestError, UnsafePathError
from epbuild.fs import safe_relpath

_ASSIGNMENT = re.compile(r"([A-Za-z0-9_.\"'-]+)\s*=")


class Locator:
    """Finds the line of a key path in the TOML text."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()

    def line(self, path: tuple[str, ...]) -> int | None:
        """The line of ``path``, else of its nearest ancestor. An ``[i]`` item is the line
        its item starts on (arrays written over several lines); keys inside it are not
        looked for further (an inline table is one line)."""
        for at, part in enumerate(path):
            if part.startswith("[") and part[1:-1].isdigit():
                start = self._find([p for p in path[:at] if not p.startswith("[")])
                item = None if start is None else self._item_line(start, int(part[1:-1]))
                if item is not None:
                    return item
                break
        keys = [p for p in path if not p.startswith("[")]
        for depth in range(len(keys), 0, -1):
            found = self._find(keys[:depth])
            if found is not None:
                return found
        return None

    def _find(self, keys: list[str]) -> int | None:
        header: list[str] = []
        best: int | None = None
        for number, raw in enumerate(self.lines, 1):
            line = raw.strip()
            if line.startswith("["):
                inner = line.split("#")[0].strip().strip("[]").strip()  # "[a.b]  # note"
                header = [k.strip().strip("\"'") for k in inner.split(".")]
                if header == keys:
                    return number
                if header[: len(keys)] == keys:
                    best = best or number  # [a.b] defines table a implicitly
                continue
            name = _ASSIGNMENT.match(line)
            if not name:
                continue
            full = header + [k.strip().strip("\"'") for k in name.group(1).split(".")]
            if full == keys:
                return number
            if full == keys[: len(full)] and len(keys) > len(full):
                # The rest of the path is inside an inline table or array on this line.
                rest = keys[len(full) :]
                if all(re.search(rf"\b{re.escape(k)}\b", line) for k in rest):
                    return number
                best = best or number
        return best

    def _item_line(self, start: int, index: int) -> int | None:
        """The line where item ``index`` of the array assigned on line ``start`` begins."""
        text = "\n".join(self.lines[start - 1 :])
        pos = text.find("=")
        if pos < 0:
            return None
        depth, item, expecting, quote = 0, -1, False, ""
        i = pos + 1
        while i < len(text):
            ch = text[i]
            if quote:
                if ch == "\\" and quote == '"':
                    i += 1
                elif text.startswith(quote, i):
                    quote = ""
            elif ch == "#":
                end = text.find("\n", i)
                i = len(text) if end < 0 else end
                continue
            elif ch.isspace():
                pass
            elif depth == 0 and ch != "[":
                return None  # not an array
            elif depth == 1 and ch == ",":
                expecting = True
            elif depth == 1 and ch == "]":
                return None
            else:
                if depth == 1 and expecting:
                    item += 1
                    if item == index:
                        return start + text.count("\n", 0, i)
                expecting = depth == 0
                if ch in "\"'":
                    quote = ch
                elif ch in "[{":
                    depth += 1
                elif ch in "]}":
                    depth -= 1
            i += 1
        return None


class Where:
    """Turns a key path into a ``ManifestError`` naming file, line and key."""

    def __init__(self, file: Path, text: str) -> None:
        self.file = file
        self.locator = Locator(text)

    def relpath(self, path: tuple[str, ...], value: str, what: str) -> str:
        """``value`` as a workspace-relative POSIX path (``fs.safe_relpath``); its refusal
        reported at ``path``."""
        try:
            return safe_relpath(value, what=what)
        except UnsafePathError as exc:
            raise self.error(path, exc.message, exc.hint) from exc

    def error(self, path: tuple[str, ...], message: str, hint: str | None = None) -> ManifestError:
        """The error for ``path`` (keys, then ``[i]`` items appended to the dotted key)."""
        key = "".join(p if p.startswith("[") else "." + p for p in path).lstrip(".")
        return ManifestError(
            message, file=str(self.file), line=self.locator.line(path), key=key, hint=hint
        )
