"""The OpenVINO adapter: Intel NPU (also GPU, CPU) blobs through the OpenVINO EP.

Two packagings exist. ``onnxruntime-ep-openvino`` is a plugin EP for the stock
``onnxruntime`` wheel (registered like QNN; devices come from ``get_ep_devices()`` with an
``ov_device`` metadata entry such as ``NPU`` or ``GPU.0``). ``onnxruntime-openvino`` is a
whole ONNX Runtime build with the EP built in, added by name. ``attach`` prefers the plugin
and falls back to the built-in EP.

Manifest ``device_type`` picks the device (default ``NPU``); it is never passed to the
plugin, which refuses device selection through options. The options the plugin only
accepts inside ``load_config`` are refused here with the equivalent ``load_config`` entry,
because the EP would only log that it ignored them. EPContext nodes carry
``source = "OpenVINOExecutionProvider"``; the context binary is written next to the ctx
model as ``<ctx stem>_OpenVINOExecutionProvider.bin`` (one per sharing group).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild.docsite import page_url
from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.providers.base import install_hint, register_plugin
from epbuild.providers.contract import (
    BaseProvider,
    ProviderConfig,
    refuse_options,
    stringify_options,
)
from epbuild.providers.distributions import dist_location, dist_version, shared_library

if TYPE_CHECKING:
    from onnxruntime import SessionOptions

EP_NAME = "OpenVINOExecutionProvider"
"""The OpenVINO EP's name: ``kOpenVINOExecutionProvider`` in ONNX Runtime's and
onnxruntime-genai's EP name constants, the name onnxruntime-openvino's built-in EP has, and
what the plugin (onnxruntime-ep-openvino) reports from ``get_ep_name()``."""
"""Name of the EP, its devices and the ``source`` of its EPContext nodes."""
PLUGIN_DIST = "onnxruntime-ep-openvino"
PROVIDER_LIB = "onnxruntime_providers_openvino"
"""The built-in EP's library in ``onnxruntime-openvino`` (``onnxruntime/capi``)."""
BUILTIN_DIST = "onnxruntime-openvino"
DEFAULT_DEVICE = "NPU"
DEVICE_RE = re.compile(r"(CPU|GPU|NPU)(\.\d+)?")
META_DEVICES = ("AUTO", "HETERO", "MULTI")
LOAD_CONFIG_DEVICES = frozenset({"CPU", "GPU", "NPU", "AUTO", "HETERO", "MULTI"})
RESHAPE_RE = re.compile(r"\s*[^\[\],]+\s*\[[^\]]*\](\s*,\s*[^\[\],]+\s*\[[^\]]*\])*\s*")

BOOL_OPTIONS = frozenset({"enable_causallm", "hint_enable_gqa", "dump_subgraphs"})
KNOWN_OPTIONS = frozenset({"device_type", "load_config", "reshape_input"}) | BOOL_OPTIONS
# Documented options the plugin EP ignores (with a log line) unless given through load_config.
LOAD_CONFIG_EQUIVALENT = {
    "precision": '{"NPU": {"INFERENCE_PRECISION_HINT": "f16"}}',
    "num_of_threads": '{"CPU": {"INFERENCE_NUM_THREADS": "1"}}',
    "num_streams": '{"CPU": {"NUM_STREAMS": "1"}}',
    "model_priority": '{"NPU": {"MODEL_PRIORITY": "LOW"}}',
    "enable_opencl_throttling": '{"GPU": {"PLUGIN_THROTTLE": "1"}}',
    "enable_qdq_optimizer": '{"NPU": {"NPU_QDQ_OPTIMIZATION": "YES"}}',
}
REFUSED = {
    "cache_dir": "an EPContext build is the cache; the model cache would only hide stale blobs",
    "device_id": 'select the device with device_type (e.g. "GPU.1")',
    "device_luid": 'select the device with device_type (e.g. "GPU.1")',
    "context": "a remote context pointer cannot be given in a manifest",
    "disable_dynamic_shapes": "give static shapes with reshape_input instead",
}

_REFUSALS = {
    **{n: (f"{n!r} cannot be used for an EPContext build", hint) for n, hint in REFUSED.items()},
    **{
        n: (
            f"the OpenVINO EP ignores {n!r} as a provider option",
            f"set it through load_config instead, e.g. load_config = '{equivalent}'",
        )
        for n, equivalent in LOAD_CONFIG_EQUIVALENT.items()
    },
}
"""Option → message and hint of its refusal."""


def normalise_device(value: str, *, key: str) -> str:
    """Upper-case ``CPU``/``GPU``/``NPU`` with an optional ``.N`` index; refuse the rest."""
    device = value.replace(" ", "").upper()
    if DEVICE_RE.fullmatch(device):
        return device
    mode = device.split(":", 1)[0]
    if mode in META_DEVICES:
        raise ManifestError(
            f"device_type {value!r} is an OpenVINO meta-device, which cannot produce "
            "EPContext models",
            key=key,
            hint="name one physical device: NPU, GPU (or GPU.0, GPU.1, ...) or CPU",
        )
    if "_" in device and DEVICE_RE.fullmatch(device.split("_", 1)[0]):
        raise ManifestError(
            f"device_type {value!r} uses the removed <device>_<precision> form",
            key=key,
            hint=f'use device_type = "{device.split("_", 1)[0]}" and set the precision with '
            'load_config, e.g. {"NPU": {"INFERENCE_PRECISION_HINT": "f16"}}',
        )
    raise ManifestError(
        f"device_type {value!r} is not an OpenVINO device",
        key=key,
        hint="use NPU, GPU (or GPU.0, GPU.1, ...) or CPU",
    )


def normalise_load_config(value: Any, *, key: str) -> str:
    """``load_config`` as canonical JSON: ``{"<DEVICE>": {"<PROPERTY>": value, ...}, ...}``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ManifestError(f"load_config is not valid JSON: {exc}", key=key) from exc
    if not isinstance(value, Mapping):
        raise ManifestError(
            "load_config must be a table of devices",
            key=key,
            hint='e.g. load_config = { NPU = { NPU_QDQ_OPTIMIZATION = "YES" } }',
        )
    for device, props in value.items():
        if device not in LOAD_CONFIG_DEVICES:
            raise ManifestError(
                f"load_config device {device!r} is not an OpenVINO device",
                key=f"{key}.{device}",
                hint="use " + ", ".join(sorted(LOAD_CONFIG_DEVICES)),
            )
        if not isinstance(props, Mapping):
            raise ManifestError(
                "each load_config device must map property names to values",
                key=f"{key}.{device}",
            )
        _check_json_values(props, key=f"{key}.{device}")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _check_json_values(props: Mapping[Any, Any], *, key: str) -> None:
    for name, item in props.items():
        if isinstance(item, Mapping):
            _check_json_values(item, key=f"{key}.{name}")
        elif not isinstance(item, (str, int, float, bool)):
            raise ManifestError(
                f"load_config value of type {type(item).__name__} is not supported",
                key=f"{key}.{name}",
            )


def normalise_bool(value: Any, *, key: str) -> str:
    """OpenVINO EP booleans are ``true``/``false`` (it refuses ``1``/``0``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value in ("true", "True", "false", "False"):
        return value.lower()
    raise ManifestError(f"{value!r} is not a boolean", key=key, hint="use true or false")


class OpenVinoProvider(BaseProvider):
    """Compiles OpenVINO blobs; needs an Intel device (the EP lists no device elsewhere)."""

    kind = "openvino"
    extra = "openvino"
    ep_dists = (BUILTIN_DIST, PLUGIN_DIST)

    def check_options(self, options: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """Refuse what the plugin ignores; normalise device, load_config and booleans."""
        refuse_options(options, _REFUSALS, key=key)
        rest = {k: v for k, v in options.items() if k != "load_config" and k not in BOOL_OPTIONS}
        opts = stringify_options(rest, key=key, allowed=KNOWN_OPTIONS)
        opts["device_type"] = normalise_device(
            opts.get("device_type", DEFAULT_DEVICE), key=f"{key}.device_type"
        )
        if "load_config" in options:
            opts["load_config"] = normalise_load_config(
                options["load_config"], key=f"{key}.load_config"
            )
        for name in BOOL_OPTIONS & options.keys():
            opts[name] = normalise_bool(options[name], key=f"{key}.{name}")
        if "reshape_input" in opts and not RESHAPE_RE.fullmatch(opts["reshape_input"]):
            raise ManifestError(
                f"reshape_input {opts['reshape_input']!r} is not a shape list",
                key=f"{key}.reshape_input",
                hint='write e.g. "input_ids[1,128],attention_mask[1,128]" (ranges as 1..64)',
            )
        return opts

    def versions(self, config: ProviderConfig) -> dict[str, str]:
        return {
            "onnxruntime": dist_version("onnxruntime"),
            PLUGIN_DIST: dist_version(PLUGIN_DIST),
            BUILTIN_DIST: dist_version(BUILTIN_DIST),
            "openvino": dist_version("openvino"),
        }

    def version_inputs(self, config: ProviderConfig) -> list[str]:
        """The EP library (its sha256 is keyed); every version is a distribution's."""
        library = self.library_path(config)
        return [library] if library else []

    def library_path(self, config: ProviderConfig) -> str | None:
        """The built-in EP's provider library in ``onnxruntime-openvino``; for the plugin
        package, the library file its ``get_library_path()`` names (not read here)."""
        site = dist_location(BUILTIN_DIST)
        if site is None:
            return None
        return shared_library(site, os.path.join("onnxruntime", "capi"), PROVIDER_LIB)

    def needs_static_shapes(self, config: ProviderConfig) -> bool:
        """For the NPU, unless ``reshape_input`` gives the shapes (OpenVINO then fixes them
        itself; CPU and GPU compile dynamic shapes)."""
        device = config.options.get("device_type", DEFAULT_DEVICE)
        return device.split(".")[0] == "NPU" and "reshape_input" not in config.options

    def sharing_refusal(self, config: ProviderConfig) -> str | None:
        """On CPU the EP ignores ``ep.share_ep_contexts`` (docs/research/openvino-ep.md);
        NPU sharing is the EP's documented case, GPU unmeasured (the post-compile check
        catches an EP that did not share)."""
        if config.options.get("device_type", DEFAULT_DEVICE).split(".")[0] == "CPU":
            return (
                f"provider {config.name!r}: the OpenVINO EP does not share weights on CPU "
                "(with ep.share_ep_contexts it still writes one context binary per model)"
            )
        return None

    def context_source(self, config: ProviderConfig) -> str:
        return EP_NAME

    def package_target(self, config: ProviderConfig) -> tuple[str, str | None]:
        """The device type it compiled for (``GPU.1`` → ``gpu``)."""
        device = config.options.get("device_type", DEFAULT_DEVICE)
        return (EP_NAME, device.split(".")[0].lower())

    def compatibility_key(self, config: ProviderConfig) -> str | None:
        """The plugin EP writes ``ep_compatibility_info.OpenVINOExecutionProvider`` (an
        OpenVINO-internal JSON document the EP checks itself when loading, so
        ``check_compatibility`` keeps the default); the EP built into onnxruntime-openvino
        writes none. Which one compiles is read from the environment being looked at
        (a toolchain's, under ``scanning``)."""
        return EP_NAME if dist_version(PLUGIN_DIST) != "absent" else None

    def explain_load_failure(self, config: ProviderConfig, message: str) -> str | None:
        """A load failure that is the package's known limit rather than a bad blob."""
        if "Unhandled exception type: 1" in message and sys.platform.startswith("linux"):
            return (
                f"{BUILTIN_DIST} {dist_version(BUILTIN_DIST)} (Linux wheel) cannot load "
                "OpenVINO EPContext blobs: its bundled OpenVINO lacks the IR frontend, so "
                "import_model fails (EP_FAIL 'Unhandled exception type: 1' = import_model); "
                "the blob itself imports with the standalone openvino package "
                f"({page_url('providers.md', 'openvino')})"
            )
        return None

    def standalone_loader(self, config: ProviderConfig) -> str | None:
        """CPU blobs are OpenVINO IR, which the standalone ``openvino`` package imports
        (NPU and GPU blobs are device binaries that no device here imports)."""
        if config.options.get("device_type", DEFAULT_DEVICE) == "CPU":
            return "epbuild.inspection.ovblob"
        return None

    def attach(
        self, ort: Any, so: SessionOptions, config: ProviderConfig, ep_name: str | None = None
    ) -> None:
        """Attach the plugin EP (registered as ``ep_name``, default the name the plugin
        gives, ``OpenVINOExecutionProvider``) or the EP built into onnxruntime-openvino
        (always ``OpenVINOExecutionProvider``)."""
        device = config.options.get("device_type", DEFAULT_DEVICE)
        options = {k: v for k, v in config.options.items() if k != "device_type"}
        try:
            plugin: Any = importlib.import_module("onnxruntime_ep_openvino")
        except ImportError:
            plugin = None
        if plugin is None and ep_name not in (None, EP_NAME):
            raise ProviderUnavailableError(
                f"the OpenVINO EP built into onnxruntime-openvino is always named {EP_NAME!r}, "
                f"not {ep_name!r}",
                hint=f"install the OpenVINO plugin EP ({install_hint(self.extra)}), or register "
                f"it as {EP_NAME}",
            )
        if plugin is not None:
            ep_name = ep_name or str(plugin.get_ep_name())
            hint = install_hint(self.extra)
            register_plugin(ort, ep_name, str(plugin.get_library_path()), hint=hint)
            chosen = pick_device([d for d in ort.get_ep_devices() if d.ep_name == ep_name], device)
            if chosen is None:
                raise ProviderUnavailableError(
                    f"the OpenVINO execution provider found no {device} device on this machine",
                    hint="it lists only Intel CPUs, GPUs and NPUs, so build on a machine with "
                    f"one (the EP itself: {hint.removeprefix('install it with ')})",
                )
            so.add_provider_for_devices([chosen], options)
        elif EP_NAME in ort.get_available_providers():
            # onnxruntime-openvino: the EP is built in and takes device_type as an option.
            so.add_provider(EP_NAME, {**options, "device_type": device})
        else:
            raise ProviderUnavailableError(
                "the OpenVINO execution provider is not installed",
                hint=install_hint(self.extra),
            )


def pick_device(devices: list[Any], device: str) -> Any | None:
    """The EP device whose ``ov_device`` is ``device`` (``GPU`` also matches ``GPU.0``)."""
    names = [(str(d.ep_metadata.get("ov_device", "")), d) for d in devices]
    for name, d in names:
        if name == device:
            return d
    if "." not in device:
        for name, d in names:
            if name.startswith(device + "."):
                return d
    return None
