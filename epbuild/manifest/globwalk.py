"""Glob patterns expanded inside the workspace without end-less walks: what
``glob.glob(pattern, root_dir=root, recursive=True)`` matches (``*``, ``?`` and ``[...]``
within a name, ``**`` across folders, hidden names only where the pattern names them, links
to folders followed), except that a walk never enters a folder it is already inside. A link
loop (``d/up -> ..``, ``d/self -> .``) then ends the walk where Python's glob, with two such
links, lists paths without end (``d/self/up/d/self/…``, 2^40 of them before the kernel's
limit on links in a path).

Each match comes with what it is (``FILE``, ``FOLDER``, ``OTHER``: a FIFO, a device, a
socket, a dangling link), known from the folder's listing: a regular file costs no ``stat``
of its own (40,000 samples in one folder are one listing)."""

from __future__ import annotations

import fnmatch
import os
import re
import stat

FILE, FOLDER, OTHER = "file", "folder", "other"
"""What a match is (through links): a regular file, a folder, anything else."""
_MAGIC = re.compile(r"[*?\[]")
_Entry = tuple[str, str, tuple[int, int]]
"""A name, what it is, and (a folder's) device and inode."""


def glob_paths(root: str, pattern: str) -> list[str]:
    """The workspace-relative POSIX paths ``pattern`` (relative, ``/``-separated) matches
    under ``root``, sorted, each once (a pattern ending in ``/``: folders only)."""
    return [path for path, _ in glob_kinds(root, pattern)]


def glob_kinds(root: str, pattern: str) -> list[tuple[str, str]]:
    """``glob_paths`` with what each match is (``FILE``, ``FOLDER`` or ``OTHER``)."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not parts:
        return []
    try:
        st = os.stat(root)
    except OSError:
        return []
    found: dict[str, str] = {}
    _match(root, "", parts, frozenset({(st.st_dev, st.st_ino)}), found)
    folders_only = pattern.endswith("/")  # as glob has it
    return sorted((p, k) for p, k in found.items() if k == FOLDER or not folders_only)


def _match(
    root: str, rel: str, parts: list[str], inside: frozenset[tuple[int, int]], found: dict[str, str]
) -> None:
    """Add to ``found`` what ``parts`` match below the folder ``rel``; ``inside``: the
    folders (device, inode) the walk is in."""
    head, rest = parts[0], parts[1:]
    here = os.path.join(root, rel) if rel else root
    if head == "**":
        if rest:
            _match(root, rel, rest, inside, found)  # no folder at all
        for name, kind, key in _entries(here):
            if name.startswith("."):
                continue
            child = _join(rel, name)
            if not rest:
                found[child] = kind
            if kind == FOLDER and key not in inside:  # a folder it is in already: a loop
                _match(root, child, parts, inside | {key}, found)
        return
    names: list[_Entry]
    if _MAGIC.search(head):
        hidden = head.startswith(".")
        names = [
            entry
            for entry in _entries(here)
            if (hidden or not entry[0].startswith(".")) and fnmatch.fnmatch(entry[0], head)
        ]
    else:
        entry = _named(here, head)
        if entry is None:
            return
        names = [entry]
    for name, kind, key in names:
        child = _join(rel, name)
        if not rest:
            found[child] = kind
        elif kind == FOLDER:
            _match(root, child, rest, inside | {key}, found)


def folder_kinds(folder: str) -> list[tuple[str, str]]:
    """Every name in ``folder`` (hidden ones too), sorted, with what it is."""
    return sorted((name, kind) for name, kind, _ in _entries(folder))


def _entries(folder: str) -> list[_Entry]:
    """``folder``'s entries (an unreadable folder has none)."""
    out = []
    try:
        with os.scandir(folder) as it:
            for entry in it:
                try:
                    if entry.is_file():
                        out.append((entry.name, FILE, (0, 0)))
                    elif entry.is_dir():
                        st = entry.stat()
                        out.append((entry.name, FOLDER, (st.st_dev, st.st_ino)))
                    else:
                        out.append((entry.name, OTHER, (0, 0)))
                except OSError:  # a link the kernel refused to follow (a loop of links)
                    out.append((entry.name, OTHER, (0, 0)))
    except OSError:
        pass
    return out


def _named(folder: str, name: str) -> _Entry | None:
    """The entry ``name`` of ``folder``; None where nothing is there (a dangling link is
    there, as ``glob`` has it)."""
    path = os.path.join(folder, name)
    try:
        st = os.stat(path)
    except OSError:
        return (name, OTHER, (0, 0)) if os.path.lexists(path) else None
    if stat.S_ISREG(st.st_mode):
        return name, FILE, (0, 0)
    if stat.S_ISDIR(st.st_mode):
        return name, FOLDER, (st.st_dev, st.st_ino)
    return name, OTHER, (0, 0)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name
