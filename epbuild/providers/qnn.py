"""The QNN adapter: Qualcomm HTP context binaries through the ``onnxruntime-qnn`` plugin."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild._dataclass import dataclass
from epbuild.errors import ManifestError, ProviderUnavailableError, UnsafePathError
from epbuild.fs import atomic_write_bytes, safe_relpath
from epbuild.providers.base import register_plugin, require_devices
from epbuild.providers.contract import BaseProvider, ProviderConfig
from epbuild.providers.distributions import dist_location, dist_version, shared_library

if TYPE_CHECKING:
    from onnxruntime import SessionOptions

EP_NAME = "QNNExecutionProvider"
"""The name epbuild registers the plugin library under (compiles, loads, packages), which
its outputs then carry; the only one onnxruntime-genai accepts (docs/research/qnn-plugin.md).
It is not part of any action key (the key names the adapter, ``qnn``)."""
LEGACY_NAME = "qnn"
"""The name epbuild registered the plugin under before: outputs built then carry
``source = "qnn"`` and ``ep_compatibility_info.qnn``, and stay valid (the EP loads both)."""
DIST = "onnxruntime-qnn"
SOURCE_ALIASES = frozenset({"qnn", "qnnexecutionprovider"})
"""EPContext ``source`` values the QNN EP loads, compared case-insensitively (measured:
docs/research/qnn-plugin.md)."""

# HTP architectures and SoC models the QNN SDK accepts. Anything else compiles silently for
# a default target or falls back to the CPU EP (ORT-QNN-FACTS.md), so we refuse it first.
HTP_ARCHS = frozenset({"68", "69", "73", "75", "79", "81"})
SOC_MODELS = frozenset(
    {
        "30",
        "36",
        "37",
        "42",
        "43",
        "52",
        "53",
        "54",
        "56",
        "57",
        "58",
        "59",
        "60",
        "62",
        "64",
        "65",
        "66",
        "67",
        "68",
        "69",
        "70",
        "72",
        "73",
        "74",
        "75",
        "76",
        "77",
        "79",
        "80",
        "81",
        "82",
        "83",
        "87",
        "88",
        "89",
        "90",
        "93",
        "94",
        "97",
    }
)
KNOWN_OPTIONS = frozenset(
    {
        "backend_type",
        "backend_path",
        "htp_arch",
        "soc_model",
        "htp_performance_mode",
        "htp_graph_finalization_optimization_mode",
        "vtcm_mb",
        "enable_htp_fp16_precision",
        "offload_graph_io_quantization",
        "enable_htp_weight_sharing",
        "profiling_level",
        "profiling_file_path",
        "rpc_control_latency",
        "device_id",
        "qnn_context_priority",
        "htp_bf16_enable",
        "enable_htp_spill_fill_buffer",
        "enable_htp_shared_memory_allocator",
        "dump_json_qnn_graph",
        "json_qnn_graph_dir",
        "qnn_saver_path",
        "op_affinity",
    }
)
FILE_OPTIONS = frozenset({"op_affinity"})
"""Options that name a file, relative to the manifest: keyed by the file's content, shipped
with the action (the worker runs in the workspace root). ``op_affinity`` is a JSON file such
as ``{"op_type": {"GroupQueryAttention": "htp"}}``: the EP leaves ops on the CPU that it
would otherwise take or refuse (GroupQueryAttention stays on the CPU without it)."""

SPILL_FILL_OPTION = "enable_htp_spill_fill_buffer"
IO_OFFLOAD = "offload_graph_io_quantization"
"""The EP's option that leaves a QDQ model's graph-input Q and graph-output DQ to the CPU
("1", its default) or takes them onto the HTP ("0")."""


@dataclass(frozen=True)
class QnnTarget:
    """A Snapdragon SoC by name: the ``htp_arch`` and ``soc_model`` options that target it."""

    title: str
    """Marketing name and part number, for comments and help text."""
    htp_arch: str
    soc_model: str


WELL_KNOWN_TARGETS: dict[str, QnnTarget] = {
    "snapdragon-8-gen-1": QnnTarget("Snapdragon 8 Gen 1 (SM8450)", "69", "36"),
    "snapdragon-8plus-gen-1": QnnTarget("Snapdragon 8+ Gen 1 (SM8475)", "69", "42"),
    "snapdragon-8-gen-2": QnnTarget("Snapdragon 8 Gen 2 (SM8550)", "73", "43"),
    "snapdragon-8s-gen-3": QnnTarget("Snapdragon 8s Gen 3 (SM8635)", "73", "68"),
    "snapdragon-8-gen-3": QnnTarget("Snapdragon 8 Gen 3 (SM8650)", "75", "57"),
    "snapdragon-8-elite": QnnTarget("Snapdragon 8 Elite (SM8750)", "79", "69"),
    "snapdragon-8-elite-gen-5": QnnTarget("Snapdragon 8 Elite Gen 5 (SM8850)", "81", "87"),
    "snapdragon-x-elite": QnnTarget("Snapdragon X Elite (SC8380XP)", "73", "60"),
}
"""SoCs ``epbuild add target`` knows by name (QNN SDK ``QNN_SOC_MODEL_*`` values); the
part numbers (``sm8650``) are accepted too (``well_known_target``)."""


def chip_of(soc_model: str) -> QnnTarget | None:
    """The SoC in ``WELL_KNOWN_TARGETS`` whose ``soc_model`` is ``soc_model``, else None."""
    return next((t for t in WELL_KNOWN_TARGETS.values() if t.soc_model == soc_model), None)


def pairing_problem(htp_arch: str, soc_model: str) -> str | None:
    """Why ``htp_arch`` and ``soc_model`` cannot go together, or None: a chip epbuild knows
    has one architecture. A ``soc_model`` the table does not name is not judged."""
    chip = chip_of(soc_model)
    if chip is None or chip.htp_arch == htp_arch:
        return None
    return (
        f"soc_model {soc_model!r} is the {chip.title}, an HTP v{chip.htp_arch} chip, "
        f"but htp_arch is {htp_arch!r}"
    )


def _pairing_hint(htp_arch: str, soc_model: str) -> str:
    chip = chip_of(soc_model)
    assert chip is not None
    others = [t for t in WELL_KNOWN_TARGETS.values() if t.htp_arch == htp_arch]
    same_arch = " or ".join(f'soc_model = "{t.soc_model}" for the {t.title}' for t in others)
    return (
        f'for the {chip.title} set htp_arch = "{chip.htp_arch}"'
        + (f"; for a v{htp_arch} chip set {same_arch}" if same_arch else "")
        + "; epbuild add target --list shows every chip epbuild knows"
    )


def well_known_target(name: str) -> QnnTarget | None:
    """The SoC called ``name`` (``snapdragon-8-gen-3`` or ``sm8650``, any case), else None."""
    key = name.lower()
    if key in WELL_KNOWN_TARGETS:
        return WELL_KNOWN_TARGETS[key]
    for target in WELL_KNOWN_TARGETS.values():
        if f"({key})" == target.title.split(" ")[-1].lower():
            return target
    return None


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


class QnnProvider(BaseProvider):
    """Compiles HTP context binaries; runs on Linux x86_64 without Qualcomm hardware."""

    kind = "qnn"
    extra = "qnn"
    quantization = "qnn"
    ep_dists = (DIST,)
    known_options = KNOWN_OPTIONS
    file_options = FILE_OPTIONS
    compatibility_device_types = frozenset({"NPU"})
    """Device types the EP judges compiled models for (``epbuild.inspection.ortcompat``):
    asked without an NPU it can crash the process (docs/research/qnn-plugin.md)."""

    quant_activations = frozenset(("uint8", "uint16", "int8"))
    """int16 activations fail ops the HTP runs in uint16 (GlobalAveragePool, measured)."""

    def refuse_quantization(
        self, activations: str, weights: str, per_channel: bool, overrides: Mapping[str, str]
    ) -> tuple[str, str, str] | None:
        """Also: 4-bit weights only signed (uint4 weights leave a Conv unplaced, per channel
        too, and a MatMul's compile empty) and per channel (per tensor, the EP leaves Conv
        unplaced)."""
        found = super().refuse_quantization(activations, weights, per_channel, overrides)
        if found is None and weights == "uint4":
            return (
                "weights",
                "uint4 weights: the HTP runs 4-bit weights signed (a Conv's are left unplaced "
                "and a MatMul compiles to nothing)",
                'use weights = "int4" with per_channel = true',
            )
        if found is None and weights in ("uint4", "int4") and not per_channel:
            return "weights", f"{weights} weights need per_channel = true", "set per_channel = true"
        return found

    def for_quantized(self, config: ProviderConfig) -> ProviderConfig:
        """The graph's input quantization and output dequantization run on the HTP too
        (``offload_graph_io_quantization = "0"``, unless the manifest says otherwise): the
        ctx model is one EPContext node with no Q/DQ node left outside it."""
        from dataclasses import replace

        if IO_OFFLOAD in config.options:
            return config
        return replace(config, options={**config.options, IO_OFFLOAD: "0"})

    def check_options(self, options: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """Backend HTP only; known architectures and SoCs, as many of each, and each chip
        ``WELL_KNOWN_TARGETS`` names with its own architecture (the EP takes any pair without
        a word, and the context is then for no chip the user meant)."""
        opts = super().check_options(options, key=key)
        for name in FILE_OPTIONS & opts.keys():
            try:
                opts[name] = safe_relpath(opts[name], what=name)
            except UnsafePathError as exc:
                raise ManifestError(exc.message, key=f"{key}.{name}", hint=exc.hint) from exc
        if "backend_type" in opts and "backend_path" in opts:
            raise ManifestError(
                "set backend_type or backend_path, not both",
                key=f"{key}.backend_path",
                hint="with both, ONNX Runtime silently falls back to the CPU EP",
            )
        if "backend_path" not in opts:
            backend = opts.setdefault("backend_type", "htp")
            if backend != "htp":
                raise ManifestError(
                    f"backend_type {backend!r} cannot produce context binaries here",
                    key=f"{key}.backend_type",
                    hint='use backend_type = "htp" (the wheel ships only the HTP backend)',
                )
        for name, allowed in (("htp_arch", HTP_ARCHS), ("soc_model", SOC_MODELS)):
            if name in opts:
                values = _split(opts[name])
                bad = [v for v in values if v not in allowed]
                if bad:
                    raise ManifestError(
                        f"{name} {bad[0]!r} is not a known value",
                        key=f"{key}.{name}",
                        hint=f"use one of {', '.join(sorted(allowed, key=int))}; the EP "
                        "would silently compile for a default target instead",
                    )
                opts[name] = ",".join(values)
        archs = _split(opts.get("htp_arch", ""))
        socs = _split(opts.get("soc_model", ""))
        if ("htp_arch" in opts and "soc_model" in opts) and len(archs) != len(socs):
            raise ManifestError(
                "htp_arch and soc_model list different numbers of targets",
                key=f"{key}.soc_model",
                hint="give one soc_model per htp_arch (multi-SoC targets are comma lists)",
            )
        if "htp_arch" in opts and "soc_model" in opts:
            for arch, soc in zip(archs, socs, strict=True):
                problem = pairing_problem(arch, soc)
                if problem:
                    raise ManifestError(
                        problem, key=f"{key}.soc_model", hint=_pairing_hint(arch, soc)
                    )
        return opts

    def is_multi_soc(self, config: ProviderConfig) -> bool:
        """Whether the configuration targets several SoCs in one context."""
        return "," in config.options.get("soc_model", "") or "," in config.options.get(
            "htp_arch", ""
        )

    def versions(self, config: ProviderConfig) -> dict[str, str]:
        return {
            "onnxruntime": dist_version("onnxruntime"),
            DIST: dist_version(DIST),
            "qnn-sdk": qnn_sdk_version(),
        }

    def version_inputs(self, config: ProviderConfig) -> list[str]:
        """Files besides dist-info directories whose stat vouches for ``versions``."""
        site = dist_location(DIST)
        if not site:
            return []
        info = os.path.join(site, "onnxruntime_qnn", "build_and_package_info.py")
        library = self.library_path(config)
        return [info, *([library] if library else [])]  # the library: its sha256 is keyed

    def library_path(self, config: ProviderConfig) -> str | None:
        """``onnxruntime_qnn``'s plugin library (what ``get_library_path()`` returns)."""
        site = dist_location(DIST)
        return (
            shared_library(site, "onnxruntime_qnn", "onnxruntime_providers_qnn") if site else None
        )

    def needs_static_shapes(self, config: ProviderConfig) -> bool:
        """Always: QNN graphs have fixed shapes; with a symbolic input dimension the EP
        takes no node, and ONNX Runtime runs the whole model on the CPU EP."""
        return True

    def context_source(self, config: ProviderConfig) -> str:
        return EP_NAME

    def accepts_source(self, config: ProviderConfig, source: str) -> bool:
        """``qnn`` or ``QnnExecutionProvider``, in any case (``SOURCE_ALIASES``)."""
        return source.lower() in SOURCE_ALIASES

    def compatibility_key(self, config: ProviderConfig) -> str | None:
        return EP_NAME

    def compatibility_keys(self, config: ProviderConfig) -> tuple[str, ...]:
        """``QNNExecutionProvider``, then ``qnn`` (outputs built before the rename)."""
        return (EP_NAME, LEGACY_NAME)

    def package_target(self, config: ProviderConfig) -> tuple[str, str | None]:
        """``QNNExecutionProvider``, no device (on x86_64 its HTP is a CPU-typed device)."""
        return (EP_NAME, None)

    def check_compatibility(self, config: ProviderConfig, info: str) -> str | None:
        # v2:6:<sdk>:<htp api>:<arch>:<soc>:<vtcm>:0 for a single target.
        if self.is_multi_soc(config):
            return None
        parts = info.split(":")
        if len(parts) < 6 or parts[0] != "v2":
            return f"unrecognised QNN compatibility info {info!r}"
        want_arch = config.options.get("htp_arch")
        want_soc = config.options.get("soc_model")
        if want_arch and parts[4] != want_arch:
            return f"context targets htp_arch {parts[4]}, the manifest asks for {want_arch}"
        if want_soc and parts[5] != want_soc:
            return f"context targets soc_model {parts[5]}, the manifest asks for {want_soc}"
        return None

    def check_installed(self, config: ProviderConfig, info: str) -> str | None:
        """Runtime side: a message if a context's SDK differs from the installed one."""
        parts = info.split(":")
        installed = qnn_sdk_version()
        if len(parts) > 2 and installed not in ("absent", "unknown") and parts[2] != installed:
            return (
                f"context was built with QNN SDK {parts[2]}, the installed onnxruntime-qnn "
                f"ships {installed}"
            )
        return None

    def load_problem(self, config: ProviderConfig, share_weights: bool) -> str | None:
        """Why a built context cannot be loaded on this host (x86_64 has no HTP), or None."""
        import platform

        if platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        if share_weights:
            return (
                "weight-shared QNN contexts cannot be loaded on x86_64 (the EP refuses them "
                "or crashes the process); load them on the target device"
            )
        if self.is_multi_soc(config):
            return "multi-SoC QNN contexts cannot be loaded on x86_64; load them on the target"
        return None

    def sharing_rewrite(self, config: ProviderConfig) -> str | None:
        """What `finish_sharing_group` changes in a sharing group's outputs (a key
        component, so groups built before the rewrite existed rebuild), or None."""
        if config.options.get(SPILL_FILL_OPTION) == "1":
            return "spill-fill max_size aligned across the group"
        return None

    def finish_sharing_group(self, config: ProviderConfig, ctx_paths: list[str]) -> None:
        """Worker side, after a weight-sharing group compiled: with spill-fill buffers on,
        every ctx model gets the group's spill-fill size (``align_spill_fill_size``)."""
        if self.sharing_rewrite(config) is not None:
            align_spill_fill_size(ctx_paths)

    def attach(
        self, ort: Any, so: SessionOptions, config: ProviderConfig, ep_name: str | None = None
    ) -> None:
        """Register the plugin library as ``ep_name`` (default ``QNNExecutionProvider``) and
        add its devices."""
        ep_name = ep_name or EP_NAME
        try:
            import onnxruntime_qnn
        except ImportError as exc:
            if exc.name != "onnxruntime_qnn":  # there, but it or what it needs is broken
                raise ProviderUnavailableError(
                    f"the QNN execution provider package onnxruntime-qnn is installed but does "
                    f"not import: {type(exc).__name__}: {exc}",
                    hint='reinstall it (pip install --force-reinstall "epbuild[qnn]"), or '
                    "install what its error names",
                ) from exc
            raise ProviderUnavailableError(
                "the QNN execution provider package onnxruntime-qnn is not installed",
                hint='install it with pip install "epbuild[qnn]"',
            ) from exc
        register_plugin(ort, ep_name, onnxruntime_qnn.get_library_path())
        devices = require_devices(ort, ep_name, extra=self.extra)
        so.add_provider_for_devices(devices, dict(config.options))


def qnn_sdk_version() -> str:
    """The QNN SDK version bundled in the onnxruntime-qnn wheel, read without importing it."""
    site = dist_location(DIST)
    if site is None:
        if dist_version(DIST) == "absent":
            return "absent"
        import importlib.metadata

        site = str(importlib.metadata.distribution(DIST).locate_file(""))
    try:
        with open(
            os.path.join(site, "onnxruntime_qnn", "build_and_package_info.py"), encoding="utf-8"
        ) as f:
            text = f.read()
    except OSError:
        return "unknown"
    match = re.search(r"qnn_version\s*=\s*['\"]([^'\"]+)", text)
    return match.group(1) if match else "unknown"


def align_spill_fill_size(ctx_paths: list[str]) -> int:
    """Give the main EPContext nodes of a sharing group's ctx models (in session order) the
    ``max_size`` of the last one; returns it. Worker side: uses epbuild's own wire-format
    reader and writer, not ``onnx`` (a toolchain holds ONNX Runtime and the EP, not onnx).

    The QNN EP writes into each ctx model the largest spill-fill buffer among the graphs its
    shared context holds so far, so only the last model's value covers the whole group; the
    HTP backend sizes the one buffer the group's contexts share from the first session
    loaded. ONNX Runtime's ``ep_weight_sharing_ctx_gen`` tool therefore rewrites the earlier
    ctx models when ``enable_htp_spill_fill_buffer`` is ``1``, so that the sessions can be
    created in any order (``UpdateEpContextModel`` in
    ``onnxruntime/test/ep_weight_sharing_ctx_gen/main.cc``). A model is rewritten only when
    a value changes, through a temporary file renamed over it.
    """
    from epbuild.onnx.proto import read_model
    from epbuild.onnx.rewrite import set_context_int

    if not ctx_paths:
        return 0
    nodes = read_model(ctx_paths[-1]).context_nodes
    size = next((_max_size(n.attributes) for n in nodes if _is_main(n.attributes)), 0)
    for path in ctx_paths[:-1]:
        with open(path, "rb") as f:
            changed = set_context_int(f.read(), "max_size", size)
        if changed is not None:
            atomic_write_bytes(path, changed)
    return size


def _is_main(attributes: dict[str, Any]) -> bool:
    """A main EPContext node (one holding a context; ``main_context`` defaults to 1)."""
    return bool(attributes.get("main_context", 1) != 0)


def _max_size(attributes: dict[str, Any]) -> int:
    value = attributes.get("max_size", 0)
    return value if isinstance(value, int) else 0
