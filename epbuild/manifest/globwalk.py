"""Glob patterns expanded inside the workspace without end-less walks: what
``glob.glob(pattern, root_dir=root, recursive=True)`` matches (``*``, ``?`` and ``[...]``
within a name, ``**`` across folders, hidden names only where the pattern names them, links
to folders followed), except that a walk never enters a folder it is already inside. A link
loop (``d/up -> ..``, ``d/self -> .``) then ends the walk where Python's glob, with two such
links, lists paths without end (``d/self/up/d/self/…``, 2^40 of them before the kernel's
limit on links in a path)."""

from __future__ import annotations

import fnmatch
import os
import re
import stat

_MAGIC = re.compile(r"[*?\[]")


def glob_paths(root: str, pattern: str) -> list[str]:
    """The workspace-relative POSIX paths ``pattern`` (relative, ``/``-separated) matches
    under ``root``, sorted, each once (a pattern ending in ``/``: folders only)."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not parts:
        return []
    try:
        st = os.stat(root)
    except OSError:
        return []
    found: set[str] = set()
    _match(root, "", parts, frozenset({(st.st_dev, st.st_ino)}), found)
    if pattern.endswith("/"):  # folders only, as glob has it
        return sorted(p for p in found if os.path.isdir(os.path.join(root, p)))
    return sorted(found)


def _match(
    root: str, rel: str, parts: list[str], inside: frozenset[tuple[int, int]], found: set[str]
) -> None:
    """Add to ``found`` what ``parts`` match below the folder ``rel``; ``inside``: the
    folders (device, inode) the walk is in."""
    head, rest = parts[0], parts[1:]
    here = os.path.join(root, rel) if rel else root
    if head == "**":
        if rest:
            _match(root, rel, rest, inside, found)  # no folder at all
        for name, is_dir, key in _entries(here):
            if name.startswith("."):
                continue
            child = _join(rel, name)
            if not rest:
                found.add(child)
            if is_dir and key not in inside:  # a folder it is in already: a link loop
                _match(root, child, parts, inside | {key}, found)
        return
    if _MAGIC.search(head):
        hidden = head.startswith(".")
        names = [
            (name, is_dir, key)
            for name, is_dir, key in _entries(here)
            if (hidden or not name.startswith(".")) and fnmatch.fnmatch(name, head)
        ]
    else:
        kind, key = _kind(os.path.join(here, head))
        if kind is None:
            return
        names = [(head, kind, key)]
    for name, is_dir, key in names:
        child = _join(rel, name)
        if not rest:
            found.add(child)
        elif is_dir:
            _match(root, child, rest, inside | {key}, found)


def _entries(folder: str) -> list[tuple[str, bool, tuple[int, int]]]:
    """``folder``'s entries: name, whether it is a folder (through a link), and the
    (device, inode) of that folder; an unreadable folder has none."""
    out = []
    try:
        with os.scandir(folder) as it:
            for entry in it:
                try:
                    if entry.is_dir():
                        st = entry.stat()
                        out.append((entry.name, True, (st.st_dev, st.st_ino)))
                        continue
                except OSError:  # a dangling link, a loop the kernel refused
                    pass
                out.append((entry.name, False, (0, 0)))
    except OSError:
        pass
    return out


def _kind(path: str) -> tuple[bool | None, tuple[int, int]]:
    """Whether ``path`` is a folder (through a link), and its (device, inode); None where
    nothing is there (a dangling link is there, as ``glob`` has it)."""
    try:
        st = os.stat(path)
    except OSError:
        return (False if os.path.lexists(path) else None), (0, 0)
    return stat.S_ISDIR(st.st_mode), (st.st_dev, st.st_ino)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name
