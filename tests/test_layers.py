"""The layer contract of docs/architecture.md, held against the code: no module imports from
a band above its own (top-level, function-level and type-only imports alike), and every
module of the package is in a band."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "epbuild"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, read once for all the rules here (the trees are not changed)."""
    return ast.parse(path.read_text(), str(path))


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
    for node in ast.walk(parsed(path)):
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
        for node in ast.walk(parsed(path)):
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


INSIDE_FUNCTIONS_MAX = 170
"""At most this many of epbuild's imports of its own modules sit inside functions: only where
one keeps onnx, onnxruntime or numpy (or the whole library) off a fast path, or a rarely
used option off its command's start (docs/architecture.md, "Imports")."""


def own_imports(path: Path, module: str) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) of each import of an epbuild module in
    ``path`` (the module ``module``), those under ``if TYPE_CHECKING:`` left out: they never
    run. ``from epbuild.a import b`` names ``epbuild.a.b`` where that is a module."""
    tree = parsed(path)
    hidden = {
        id(n)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for n in ast.walk(top)
    }
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if id(child) not in hidden:
                if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                    if child.module == "epbuild" or child.module.startswith("epbuild."):
                        names = [f"{child.module}.{a.name}" for a in child.names]
                        subs = [n for n in names if _is_module(n)]
                        targets = subs if subs and len(subs) == len(names) else [child.module]
                        found.extend((child.lineno, t, inside) for t in targets)
                elif isinstance(child, ast.Import):
                    found.extend(
                        (child.lineno, a.name, inside)
                        for a in child.names
                        if a.name.split(".")[0] == "epbuild"
                    )
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return [f for f in found if f[1] != module]


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return path.is_dir() or path.with_suffix(".py").is_file()


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, dict[str, int]], int, int]:
    """Module → {module it imports: line}, with how many of the package's imports of itself
    there are and how many of them sit inside functions."""
    edges: dict[str, dict[str, int]] = {}
    total = inside = 0
    for path in sorted(package.rglob("*.py")):
        name = module_name(path)
        deps = edges.setdefault(name, {})
        for line, target, in_function in own_imports(path, name):
            total += 1
            inside += in_function
            if target != "epbuild":
                deps.setdefault(target, line)
    return edges, total, inside


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Function-level imports count: an import inside a function hides a circle from Python,
    not from the structure."""
    edges, _, _ = import_graph()
    found = circles(edges)
    lines = [
        " → ".join(f"{m} ({edges[m].get(c[(i + 1) % len(c)], '?')})" for i, m in enumerate(c))
        for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_few_own_imports_sit_inside_functions() -> None:
    _, total, inside = import_graph()
    assert inside <= INSIDE_FUNCTIONS_MAX, (
        f"{inside} of {total} imports of epbuild's own modules are inside functions (at most "
        f"{INSIDE_FUNCTIONS_MAX}): import at the top unless it keeps onnx, onnxruntime or "
        "numpy off a fast path"
    )


def test_the_check_sees_a_circle_through_a_function_level_import() -> None:
    edges = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 2}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []
