"""epbuild: an incremental, cached build system for ONNX Runtime EPContext models.

The public API is imported lazily so that ``epbuild`` stays cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import BuildResult, build, clean, status

__all__ = ["BuildResult", "build", "clean", "status"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(name)
