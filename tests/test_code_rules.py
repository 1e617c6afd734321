"""Code rules CI holds: one way to write a file, one way to take a lock, short functions."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "epbuild"
LONGEST = 60
"""Lines a function may span (its signature and docstring included)."""

# Renames that move a finished file into place rather than write one; each is the point of
# its module.
RENAMES_ALLOWED = {
    "fs.py",  # the file-writing API itself
    "engine/staging.py",  # commits staged outputs (already complete) into the output tree
    "executors/worker.py",  # moves the chosen compile's outputs into the staging directory
    "shipping/writer.py",  # puts a dead run's set-aside package back
}


@functools.cache
def _modules() -> list[tuple[str, ast.Module]]:
    """Every module of epbuild parsed, once per test process (the rules only read the trees)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        found.append((rel, ast.parse(path.read_text(encoding="utf-8"))))
    return found


def _calls(tree: ast.Module, module: str, names: set[str]) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == module and f.attr in names:
                lines.append(node.lineno)
    return lines


def test_no_function_is_longer_than_sixty_lines() -> None:
    long = [
        f"{rel}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for rel, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > LONGEST
    ]
    assert long == [], "split these into named steps:\n" + "\n".join(long)


def test_files_are_written_through_fs() -> None:
    """A temp file renamed into place is written by ``epbuild.fs`` (atomic_output and
    friends), which fsyncs what must survive a power cut; no module rolls its own."""
    found = [
        f"{rel}:{line}"
        for rel, tree in _modules()
        if rel not in RENAMES_ALLOWED
        for line in _calls(tree, "os", {"replace", "rename"})
        + _calls(tree, "tempfile", {"mkstemp", "NamedTemporaryFile"})
    ]
    assert found == [], "use epbuild.fs.atomic_output / new_directory:\n" + "\n".join(found)


def test_locks_are_taken_through_state_locks() -> None:
    """Every inter-process lock goes through ``epbuild.state.locks`` (one waiting message,
    ``--lock-timeout`` honoured), which takes them with ``state.sharedlock``; nothing
    imports filelock (not a dependency: tests use it to show its locks and ours exclude)."""
    found = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("filelock"):
                found.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Import) and any(
                a.name.startswith("filelock") for a in node.names
            ):
                found.append(f"{rel}:{node.lineno}")
    assert found == [], "use epbuild.state.locks.hold / try_hold:\n" + "\n".join(found)
