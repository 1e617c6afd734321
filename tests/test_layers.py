"""The layer contract of docs/architecture.md, held against the code: no module imports from
a band above its own (top-level, function-level and type-only imports alike), and every
module of the package is in a band."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "epbuild"


def bands() -> list[list[str]]:
    """The bands of the architecture document's first block, top first: each a list of
    package-relative files (``api.py``) and folders (``engine/``)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]
    found: list[list[str]] = [[]]
    for line in block.splitlines():
        if line.strip() == "│":
            found.append([])
            continue
        for token in line.split():
            if not re.fullmatch(r"[\w./]+(/|\.py)", token):
                break
            found[-1].append(token)
    return [b for b in found if b]


def band_of(rel: str, layers: list[list[str]]) -> int | None:
    """The band a file is named in, else the band of the folder it is in."""
    for i, layer in enumerate(layers):
        if rel in layer:
            return i
    for i, layer in enumerate(layers):
        if any(entry.endswith("/") and rel.startswith(entry) for entry in layer):
            return i
    return None


def module_file(module: str) -> str:
    """``epbuild.a.b`` → ``a/b.py`` or ``a/b/__init__.py`` (package-relative)."""
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    if path.is_dir() or not parts:
        return "/".join([*parts, "__init__.py"])
    return "/".join(parts) + ".py"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of an epbuild module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "epbuild":
                found += [(node.lineno, f"epbuild.{a.name}") for a in node.names]
            elif node.module.startswith("epbuild."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("epbuild")]
    return found


def test_every_module_is_in_a_band() -> None:
    layers = bands()
    assert len(layers) >= 5, layers
    missing = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if band_of(str(p.relative_to(PACKAGE)), layers) is None
    ]
    assert not missing, f"add these to the block in docs/architecture.md: {missing}"


def test_no_module_imports_from_a_band_above() -> None:
    layers = bands()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        mine = band_of(rel, layers)
        assert mine is not None
        for line, module in imports(path):
            theirs = band_of(module_file(module), layers)
            if theirs is not None and theirs < mine:
                upward.append(f"{rel}:{line} imports {module} (a band above)")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule itself: a low module importing the CLI is found."""
    low = tmp_path / "low.py"
    low.write_text("def f():\n    from epbuild.frontends.cli import main\n")
    layers = bands()
    ((line, module),) = imports(low)
    assert band_of(module_file(module), layers) == 0 and line == 2
    assert band_of("fs.py", layers) == len(layers) - 1


def test_no_adapter_member_is_looked_up_by_name() -> None:
    """The adapter contract is ``BaseProvider``: every member has a default, so code calls
    it directly and mypy sees it; ``getattr(x, "<member>")`` would hide a rename."""
    from epbuild.providers.base import BaseProvider

    members = {name for name in dir(BaseProvider) if not name.startswith("__")}
    members |= set(BaseProvider.__annotations__)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in members
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.args[1].value}")
    assert not found, "\n".join(found)
