"""The generic plugin-EP adapter: any EP shared library registered with ONNX Runtime.

Manifest settings beside ``ep = "plugin"``: ``library`` (path to the EP's shared library),
``ep_name`` (the name epbuild registers the library under, and its packages' variants
declare: use the EP's conventional name, the one the apps that load it register it as — e.g.
``NvTensorRTRTXExecutionProvider`` for NVIDIA's TensorRT RTX plugin, the name in ONNX
Runtime's and onnxruntime-genai's EP name constants), optional ``device_type``
(``cpu``, ``gpu`` or ``npu``) and ``source`` (the ``source`` its EPContext nodes carry,
default ``ep_name``). Provider options pass through as strings: epbuild cannot know them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.providers.base import install_hint, register_plugin, require_devices
from epbuild.providers.contract import BaseProvider, ProviderConfig
from epbuild.providers.distributions import dist_version

if TYPE_CHECKING:
    from onnxruntime import SessionOptions

DEVICE_TYPES = ("cpu", "gpu", "npu")
SETTINGS = ("library", "ep_name", "device_type", "source")
LIBRARY_KEY = "plugin-library"
"""Key of the library digest in ``versions()``: a rebuilt library rebuilds every action."""

# (path, inode, size, mtime_ns) -> digest; the coordinator asks once per action.
_digests: dict[tuple[str, int, int, int], str] = {}


def library_digest(path: str) -> str:
    """First 16 hex digits of the library's SHA-256, or ``"absent"`` when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return "absent"
    memo = (os.path.abspath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if memo not in _digests:
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except OSError:
            return "absent"
        _digests[memo] = h.hexdigest()[:16]
    return _digests[memo]


def _setting(settings: Mapping[str, Any], name: str, *, key: str) -> str | None:
    value = settings.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ManifestError(f"{name} must be a non-empty string", key=f"{key}.{name}")
    return value.strip()


class PluginProvider(BaseProvider):
    """Any plugin EP library; options are the EP's own and pass through unchecked."""

    kind = "plugin"

    def check_settings(self, settings: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """``library`` and ``ep_name`` required; ``device_type`` and ``source`` optional."""
        for name in settings:
            if name not in SETTINGS:
                raise ManifestError(
                    f"{name!r} is not a setting of the plugin provider",
                    key=f"{key}.{name}",
                    hint="settings: " + ", ".join(SETTINGS),
                )
        out: dict[str, str] = {}
        for name in ("library", "ep_name"):
            value = _setting(settings, name, key=key)
            if value is None:
                raise ManifestError(
                    f"the plugin provider needs {name!r}",
                    key=f"{key}.{name}",
                    hint='e.g. library = "libs/libmy_ep.so", ep_name = "MyExecutionProvider"',
                )
            out[name] = value
        device_type = _setting(settings, "device_type", key=key)
        if device_type is not None:
            if device_type.lower() not in DEVICE_TYPES:
                raise ManifestError(
                    f"device_type {device_type!r} is not a device type",
                    key=f"{key}.device_type",
                    hint="use one of " + ", ".join(DEVICE_TYPES),
                )
            out["device_type"] = device_type.lower()
        out["source"] = _setting(settings, "source", key=key) or out["ep_name"]
        return out

    def versions(self, config: ProviderConfig) -> dict[str, str]:
        return {
            "onnxruntime": dist_version("onnxruntime"),
            LIBRARY_KEY: library_digest(config.resolve(config.settings["library"])),
        }

    def version_inputs(self, config: ProviderConfig) -> list[str]:
        """The library file: its stat vouches for its digest in ``versions``."""
        return [config.resolve(config.settings["library"])]

    def library_path(self, config: ProviderConfig) -> str | None:
        """The ``library`` setting's file."""
        return config.resolve(config.settings["library"])

    def needs_static_shapes(self, config: ProviderConfig) -> bool:
        """When it compiles for ``device_type = "npu"``."""
        return config.settings.get("device_type") == "npu"

    def context_source(self, config: ProviderConfig) -> str:
        return config.settings.get("source") or config.settings["ep_name"]

    def compatibility_key(self, config: ProviderConfig) -> str | None:
        # check_compatibility keeps the default: a third-party EP's format is its own.
        return config.settings["ep_name"]

    def package_target(self, config: ProviderConfig) -> tuple[str, str | None]:
        """The name it registers, and ``device_type`` where set."""
        return (config.settings["ep_name"], config.settings.get("device_type"))

    def attach(
        self, ort: Any, so: SessionOptions, config: ProviderConfig, ep_name: str | None = None
    ) -> None:
        """Register the library as ``ep_name`` (default its ``ep_name`` setting) and add its
        devices."""
        ep_name = ep_name or config.settings["ep_name"]
        # Absolute: ONNX Runtime looks a relative library path up in its own directory.
        library = os.path.abspath(config.resolve(config.settings["library"]))
        if not os.path.isfile(library):
            raise ProviderUnavailableError(
                f"plugin EP library {library} does not exist", hint=install_hint(self.extra)
            )
        register_plugin(ort, ep_name, library, hint=install_hint(self.extra))
        devices = require_devices(
            ort, ep_name, extra=self.extra, device_type=config.settings.get("device_type")
        )
        so.add_provider_for_devices(devices, dict(config.options))
