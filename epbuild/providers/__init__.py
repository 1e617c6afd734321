"""Provider adapters: one singleton per manifest ``ep`` value.

The built-in adapters are imported on first use. Third-party adapters register under the
``epbuild.providers`` entry-point group (``name = "package.module:AdapterClass"``); entry
points are read only for a kind that is not built in, so the no-op path never scans them.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from epbuild.docsite import page_url
from epbuild.errors import ManifestError
from epbuild.providers.contract import BaseProvider, Provider

ENTRY_POINT_GROUP = "epbuild.providers"
BUILTIN: dict[str, tuple[str, str]] = {
    "qnn": ("qnn", "QnnProvider"),
    "plugin": ("plugin", "PluginProvider"),
    "openvino": ("openvino", "OpenVinoProvider"),
    "tensorrt": ("tensorrt", "TensorRtProvider"),
}
_REQUIRED = (
    "kind",
    "extra",
    "shares_weights",
    "validate_options",
    "versions",
    "context_source",
    "context_options",
    "compatibility_key",
    "check_compatibility",
    "attach",
)

_cache: dict[str, Provider] = {}
_lock = threading.Lock()


def get_provider(kind: str) -> Provider:
    """The adapter for a manifest ``ep`` value (built in, or from an entry point)."""
    adapter = _cache.get(kind)
    if adapter is not None:
        return adapter
    with _lock:
        if kind not in _cache:
            _cache[kind] = _load(kind)
        return _cache[kind]


def known_kinds() -> list[str]:
    """Built-in kinds, then third-party ones, each once."""
    kinds = list(BUILTIN)
    for ep in _entry_points():
        if ep.name not in kinds:
            kinds.append(ep.name)
    return kinds


def _load(kind: str) -> Provider:
    if kind in BUILTIN:
        module, cls = BUILTIN[kind]
        factory = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
        adapter: Provider = factory()
        return adapter
    for ep in _entry_points():
        if ep.name == kind:
            return _third_party(kind, ep)
    raise ManifestError(
        f"unknown provider adapter {kind!r}",
        hint="known: "
        + ", ".join(known_kinds())
        + f"; other adapters register under the {ENTRY_POINT_GROUP!r} entry-point group",
    )


def _entry_points() -> list[Any]:
    import importlib.metadata

    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _third_party(kind: str, ep: Any) -> Provider:  # an importlib.metadata.EntryPoint
    where = f"entry point {ep.name} = {ep.value!r}"
    try:
        obj = ep.load()
        adapter = obj() if isinstance(obj, type) else obj
    except Exception as exc:  # a broken plug-in must not take the traceback to the user
        raise ManifestError(
            f"provider adapter {kind!r} could not be loaded: {type(exc).__name__}: {exc}",
            hint=f"check the package that declares {where}",
        ) from exc
    if not isinstance(adapter, BaseProvider):
        raise ManifestError(
            f"provider adapter {kind!r} lacks the adapter contract: "
            f"{type(adapter).__name__} is not a subclass of epbuild.providers.base.BaseProvider",
            hint=f"{where} must name a subclass of BaseProvider (see "
            f"{page_url('providers.md', 'writing-an-adapter')})",
        )
    if adapter.kind != kind:
        raise ManifestError(
            f"provider adapter {kind!r} says its kind is {adapter.kind!r}",
            hint=f"make {where} and the adapter's kind agree",
        )
    return adapter
