"""Print the package's shape: modules per folder, the longest functions, formatter markers.

``python benchmarks/code_shape.py [--top N]``: the figures the architecture notes quote.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "epbuild"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top", type=int, default=10, help="how many long functions to list")
    args = parser.parse_args()
    per_folder: collections.Counter[str] = collections.Counter()
    functions: list[tuple[int, str]] = []
    markers = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        folder = str(rel.parent) if str(rel.parent) != "." else "(top)"
        if path.name != "__init__.py" or folder == "(top)":
            per_folder[folder] += 1
        text = path.read_text(encoding="utf-8")
        markers += text.count("# fmt: skip") + text.count("# fmt: off")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((length, f"{rel}:{node.lineno} {node.name}"))
    print("modules per folder:")
    for folder, count in sorted(per_folder.items()):
        print(f"  {folder:12} {count}")
    print(f"  {'total':12} {sum(per_folder.values())}")
    print(f"longest functions (of {len(functions)}):")
    for length, where in sorted(functions, reverse=True)[: args.top]:
        print(f"  {length:4} {where}")
    print(f"formatter markers (fmt: skip/off): {markers}")


if __name__ == "__main__":
    main()
