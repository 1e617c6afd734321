"""Which files a group's model entries name: globs expanded inside the workspace, never into
epbuild's own directories or outputs (packages, a directory cache, ctx models)."""

from __future__ import annotations

import os
import posixpath
import re
import sys
from pathlib import Path

from epbuild._names import CACHE_LAYOUT, CTX_SUFFIX, PACKAGE_MANIFEST
from epbuild.errors import ManifestError
from epbuild.manifest.globwalk import FILE, glob_kinds
from epbuild.manifest.locate import Where

_GLOB_CHARS = re.compile(r"[*?\[]")


def is_pattern(entry: str) -> bool:
    """Whether a model entry is a glob pattern."""
    return bool(_GLOB_CHARS.search(entry))


def expand_entry(
    where: Where,
    root: Path,
    at: tuple[str, ...],
    raw: str,
    pattern: str,
    glob: bool,
    excluded: tuple[str, ...],
) -> list[str]:
    """The models one entry names: refuses a path inside epbuild's own directories and a
    pattern that matches nothing (saying when it matches only there)."""
    inside = [
        (what, d)
        for what, d in zip(("output", "state", "cache"), excluded, strict=False)
        if pattern == d or pattern.startswith(d + "/")
    ]
    if inside and not glob:
        raise where.error(
            at,
            f"model {raw!r} is inside the {inside[0][0]} directory {inside[0][1]!r}, "
            "where epbuild writes and removes files",
            "give out_dir (and state_dir) directories of their own, e.g. "
            'out_dir = "build", and keep the models elsewhere',
        )
    expanded = expand(root, pattern, excluded)
    if not expanded:
        hidden = expand(root, pattern, ())
        raise where.error(
            at,
            f"pattern {raw!r} matches no files"
            + (
                f" outside epbuild's own directories ({', '.join(sorted(set(excluded)))}): "
                f"it matches only {hidden[0]!r}"
                + (f" and {len(hidden) - 1} more there" if len(hidden) > 1 else "")
                if hidden
                else ""
            ),
            "give out_dir (and state_dir) directories of their own, e.g. "
            'out_dir = "build", and keep the models elsewhere'
            if hidden
            else "add the models, or fix the pattern (relative to the manifest's directory)",
        )
    _refuse_odd_names(where, at, raw, pattern, expanded)
    return expanded


def _refuse_odd_names(
    where: Where, at: tuple[str, ...], raw: str, pattern: str, expanded: list[str]
) -> None:
    """Refuse a model a pattern found whose name holds a backslash, or is not text in the
    file-name encoding: epbuild names outputs and records after it."""
    odd = next((p for p in expanded if "\\" in p), None)
    if odd is not None:
        renamed = odd.replace("\\", "_")
        raise where.error(
            at,
            f"pattern {raw!r} matches {_shown(odd)}, whose name holds a backslash: epbuild "
            "names the model's outputs and the files its ctx model references after it, and "
            "a backslash in those reads as a folder separator (Windows, ONNX Runtime)",
            f"rename the file (e.g. to {_shown(renamed)}), or narrow the pattern so that it "
            "does not match it",
        )
    odd = next((p for p in expanded if not _spelled(p)), None)
    if odd is not None and is_pattern(pattern):  # a listed name: ``check_model``
        raise where.error(
            at,
            f"pattern {raw!r} matches {_shown(odd)}, whose name is not text in the file-name "
            f"encoding ({sys.getfilesystemencoding()}): epbuild names the model's outputs and "
            "records after it",
            "rename the file to UTF-8 text, or narrow the pattern so that it does not match it"
            + _LOCALE_HINT,
        )


_LOCALE_HINT = (
    "; or run epbuild under a UTF-8 locale (LC_ALL=C.UTF-8) or with PYTHONUTF8=1"
    if sys.getfilesystemencoding() != "utf-8"
    else ""
)
"""What a message about a file name adds where Python's file-name encoding is not UTF-8
(``LC_ALL=C`` with ``PYTHONUTF8=0``)."""


def _spelled(path: str) -> bool:
    """Whether ``path`` is text in the file-name encoding: a name that is not (bytes
    ``os.scandir`` could only carry as surrogate escapes) cannot go into a UTF-8 record."""
    try:
        path.encode(sys.getfilesystemencoding())
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: str) -> str:
    """A found file's path in a message: as it is, or quoted as Python does when it holds
    what a terminal would not show."""
    return path if path.isprintable() else repr(path)


def expand(root: Path, pattern: str, excluded: tuple[str, ...]) -> list[str]:
    """The files ``pattern`` names (itself when it is no pattern), outside the ``excluded``
    directories and less epbuild's own outputs."""
    if not _GLOB_CHARS.search(pattern):
        return [pattern]
    # Relative to the workspace (its path may contain glob characters: "proj[1]"); a link
    # loop under "**" ends the walk.
    base = str(root)
    found = [p for p, kind in glob_kinds(base, pattern) if kind == FILE]
    found = [p for p in found if not any(p == d or p.startswith(d + "/") for d in excluded)]
    return _not_outputs(base, found)


def _not_outputs(base: str, found: list[str]) -> list[str]:
    """``found`` less epbuild's own outputs, wherever they are: anything inside a model
    package (a folder holding ``PACKAGE_MANIFEST``) or a directory cache, and ctx models
    (``*_ctx.onnx`` with EPContext nodes). Costs a few stats per folder, and reads only the
    ctx-named files a pattern matched."""
    verdicts: dict[str, bool] = {}

    def epbuild_folder(folder: str) -> bool:
        if folder in ("", "."):
            return False
        if folder not in verdicts:
            here = os.path.join(base, folder)
            verdicts[folder] = (
                os.path.isfile(os.path.join(here, PACKAGE_MANIFEST))
                or (
                    os.path.isdir(os.path.join(here, CACHE_LAYOUT, "objects"))
                    and os.path.isdir(os.path.join(here, CACHE_LAYOUT, "entries"))
                )
                or epbuild_folder(posixpath.dirname(folder))
            )
        return verdicts[folder]

    return [
        p
        for p in found
        if not epbuild_folder(posixpath.dirname(p))
        and not (p.endswith(CTX_SUFFIX) and _has_context_nodes(os.path.join(base, p)))
    ]


def _has_context_nodes(path: str) -> bool:
    """Whether the model at ``path`` holds EPContext nodes (a compiled output, not a source);
    an unreadable one is left to the model checks."""
    from epbuild.onnx.proto import ProtoError, read_model

    try:
        return bool(read_model(path).context_nodes)
    except (OSError, ProtoError):
        return False


def check_model(
    where: Where, root: Path, model: str, path: tuple[str, ...]
) -> ManifestError | None:
    """Why the listed ``model`` cannot be used (it is missing or not a file); None if it can."""
    import stat

    if not _spelled(model):
        return where.error(
            path,
            f"model file {model!r} cannot be named in the file-name encoding "
            f"({sys.getfilesystemencoding()})",
            "rename the file and the manifest's entry to ASCII" + _LOCALE_HINT,
        )
    try:
        mode = os.stat(os.path.join(root, model)).st_mode
    except OSError:
        return where.error(
            path,
            f"model file {model!r} does not exist",
            "check the path (it is relative to the manifest's directory)",
        )
    if not stat.S_ISREG(mode):
        return where.error(path, f"{model!r} is not a file")
    return None
