"""Everything an adapter author imports: the contract (`providers.contract`), what is
installed (`providers.distributions`), and the worker-side helpers an adapter's ``attach``
calls (below: options as strings, plugin registration, device selection, install hints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epbuild.errors import ProviderUnavailableError
from epbuild.providers.contract import BaseProvider, Provider, ProviderConfig, stringify_options
from epbuild.providers.distributions import (
    COMPILE_API_SINCE,
    ORT_DISTS,
    canonical_name,
    dist_location,
    dist_version,
    forget_dist_info,
    has_compile_api,
    installed_distributions,
    onnxruntime_version,
    scanning,
    shared_library,
)

if TYPE_CHECKING:
    import onnxruntime

__all__ = [
    "COMPILE_API_SINCE",
    "ORT_DISTS",
    "BaseProvider",
    "Provider",
    "ProviderConfig",
    "canonical_name",
    "dist_location",
    "dist_version",
    "forget_dist_info",
    "has_compile_api",
    "install_hint",
    "installed_distributions",
    "onnxruntime_version",
    "register_plugin",
    "require_devices",
    "scanning",
    "shared_library",
    "stringify_options",
]


_registered: set[str] = set()


def register_plugin(ort: onnxruntime, name: str, library: str, *, hint: str | None = None) -> None:
    """Register a plugin EP library once per process."""
    if name in _registered:
        return
    try:
        ort.register_execution_provider_library(name, library)
    except Exception as exc:  # ORT raises its own pybind classes
        if "already registered" not in str(exc):
            raise ProviderUnavailableError(
                f"could not register execution provider library {library}: {exc}", hint=hint
            ) from exc
    _registered.add(name)


def require_devices(
    ort: onnxruntime, ep_name: str, *, extra: str, device_type: str | None = None
) -> list[Any]:
    """EP devices named ``ep_name`` (optionally of one hardware type), or a clear error."""
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep_name]
    if device_type is not None:
        wanted = device_type.upper()
        devices = [d for d in devices if d.device.type.name == wanted]
    if not devices:
        raise ProviderUnavailableError(
            f"execution provider {ep_name!r} found no device on this machine"
            + (f" of type {device_type}" if device_type else ""),
            hint=install_hint(extra) + "; the device must be on this machine",
        )
    return devices


def install_hint(extra: str) -> str:
    """How to install an adapter's EP package; ``extra=""`` for EPs epbuild has no extra for."""
    if extra:
        return f'install it with pip install "epbuild[{extra}]"'
    return "install the EP's own package and check the library path"
