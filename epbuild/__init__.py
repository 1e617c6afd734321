"""epbuild: an incremental, cached build system for ONNX Runtime EPContext models.

The public API is imported lazily so that ``epbuild`` stays cheap to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epbuild._version import __version__ as __version__

if TYPE_CHECKING:
    from epbuild.api import (
        ActionResult,
        ActionStatus,
        BuildResult,
        EditResult,
        InitResult,
        Outcome,
        StatusResult,
        add_models,
        add_provider,
        add_target,
        build,
        clean,
        init,
        init_from,
        status,
    )
    from epbuild.cache.operations import (
        ArchiveReport,
        CacheVerifyReport,
        ExportReport,
        PruneReport,
        cache_key,
        export_cache,
        import_cache,
        prune_cache,
        verify_cache,
    )
    from epbuild.inspection.detail import ActionDetail, status_detail
    from epbuild.inspection.verify import VerifyResult, verify_outputs
    from epbuild.runtime import BuiltAction, open_action, open_models
    from epbuild.shipping.opening import open_package
    from epbuild.shipping.package import PackageResult, package
    from epbuild.watching import Cycle, watch

__all__ = [
    "ActionDetail",
    "ActionResult",
    "ActionStatus",
    "ArchiveReport",
    "BuildResult",
    "BuiltAction",
    "CacheVerifyReport",
    "Cycle",
    "EditResult",
    "ExportReport",
    "InitResult",
    "Outcome",
    "PackageResult",
    "PruneReport",
    "StatusResult",
    "VerifyResult",
    "add_models",
    "add_provider",
    "add_target",
    "build",
    "cache_key",
    "clean",
    "export_cache",
    "import_cache",
    "init",
    "init_from",
    "open_action",
    "open_models",
    "open_package",
    "package",
    "prune_cache",
    "status",
    "status_detail",
    "verify_cache",
    "verify_outputs",
    "watch",
]
# Functions that live outside api.py (their names differ from their modules' names, so
# importing a submodule never shadows a function).
_MODULES = {
    "ActionDetail": "inspection.detail",
    "BuiltAction": "runtime",
    "VerifyResult": "inspection.verify",
    "status_detail": "inspection.detail",
    "verify_outputs": "inspection.verify",
    "open_action": "runtime",
    "open_models": "runtime",
    "open_package": "shipping.opening",
    "package": "shipping.package",
    "PackageResult": "shipping.package",
    "ArchiveReport": "cache.operations",
    "CacheVerifyReport": "cache.operations",
    "ExportReport": "cache.operations",
    "PruneReport": "cache.operations",
    "cache_key": "cache.operations",
    "export_cache": "cache.operations",
    "import_cache": "cache.operations",
    "prune_cache": "cache.operations",
    "verify_cache": "cache.operations",
    "Cycle": "watching",
    "watch": "watching",
}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = importlib.import_module(f".{_MODULES.get(name, 'api')}", __name__)
        return getattr(module, name)
    raise AttributeError(name)
