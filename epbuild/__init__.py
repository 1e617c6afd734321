"""epbuild: an incremental, cached build system for ONNX Runtime EPContext models.

The public API is imported lazily so that ``epbuild`` stays cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import BuildResult, build, clean, status
    from .report import status_detail
    from .runtime import open_action, open_models
    from .verify import verify_outputs

__all__ = [
    "BuildResult",
    "build",
    "clean",
    "open_action",
    "open_models",
    "status",
    "status_detail",
    "verify_outputs",
]
# Functions that live outside api.py (their names differ from their modules' names, so
# importing a submodule never shadows a function).
_MODULES = {
    "status_detail": "report",
    "verify_outputs": "verify",
    "open_action": "runtime",
    "open_models": "runtime",
}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = importlib.import_module(f".{_MODULES.get(name, 'api')}", __name__)
        return getattr(module, name)
    raise AttributeError(name)
