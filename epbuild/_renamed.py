"""Old module names that still import: ``epbuild.inspect`` (renamed ``epbuild.inspection``,
whose old name shadowed the standard library's ``inspect`` when Python ran from inside the
package directory).

Only the command-line modules still use the old name; they move to the new one with the
command-line split, and this finder goes with them.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

RENAMED = {"epbuild.inspect": "epbuild.inspection"}
"""Old package name → new."""


class _Alias:
    """Loads an old name as the module of its new name (one module object, two names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module already ran."""


class RenamedFinder:
    """A ``sys.meta_path`` finder for the names in `RENAMED` and their submodules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        for old, new in RENAMED.items():
            if name == old or name.startswith(old + "."):
                loader = _Alias(new + name[len(old) :])
                is_package = name == old
                return ModuleSpec(name, loader, is_package=is_package)  # type: ignore[arg-type]
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, RenamedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, RenamedFinder())  # before the path finder: one module object
