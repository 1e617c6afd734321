"""The TensorRT adapter: NVIDIA TensorRT engines through the EP built into ``onnxruntime-gpu``.

The TensorRT EP writes its ctx model itself, driven by its own provider options
(``trt_dump_ep_context_model``, ``trt_ep_context_file_path``, ``trt_ep_context_embed_mode``;
they win over the ``ep.context_*`` session options), so ``context_options`` returns them for
the worker to merge in, and the manifest may not set them. With embed mode 0 the engine
cache must be on: the ctx node then references the ``.engine`` file by a path relative to
the ctx model, and the EP refuses absolute paths and ``..`` when it loads one. Its EPContext
nodes carry ``embed_mode``, ``ep_cache_context``, ``hardware_architecture`` (the GPU's
compute capability) and ``onnx_model_filename``, but no ``source``. Engines are specific to
the GPU model and the TensorRT version, so both go into the action key.
"""

from __future__ import annotations

import functools
import glob
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.providers.base import install_hint
from epbuild.providers.contract import BaseProvider, ProviderConfig, refuse_options
from epbuild.providers.distributions import dist_version

if TYPE_CHECKING:
    from onnxruntime import SessionOptions

EP_NAME = "TensorrtExecutionProvider"
"""The EP built into onnxruntime-gpu (``kTensorrtExecutionProvider`` in ONNX Runtime's
constants); being built in, it cannot be registered under another name."""
DIST = "onnxruntime-gpu"
# TensorRT wheels; the first one installed names the version. Libraries installed outside
# pip (apt, a tarball) cannot be seen without loading them and show as "absent".
TENSORRT_DISTS = (
    "tensorrt-cu13-libs",
    "tensorrt-cu12-libs",
    "tensorrt-cu11-libs",
    "tensorrt-libs",
    "tensorrt-cu13",
    "tensorrt-cu12",
    "tensorrt-cu11",
    "tensorrt",
)

BOOL_OPTIONS = frozenset(
    {
        "trt_fp16_enable",
        "trt_int8_enable",
        "trt_int8_use_native_calibration_table",
        "trt_dla_enable",
        "trt_dump_subgraphs",
        "trt_engine_cache_enable",
        "trt_weight_stripped_engine_enable",
        "trt_engine_decryption_enable",
        "trt_force_sequential_engine_build",
        "trt_context_memory_sharing_enable",
        "trt_layer_norm_fp32_fallback",
        "trt_timing_cache_enable",
        "trt_force_timing_cache",
        "trt_detailed_build_log",
        "trt_build_heuristics_enable",
        "trt_sparsity_enable",
        "trt_cuda_graph_enable",
        "trt_engine_hw_compatible",
    }
)
# name -> (minimum, maximum or None)
INT_OPTIONS: dict[str, tuple[int, int | None]] = {
    "device_id": (0, None),
    "trt_max_partition_iterations": (1, None),
    "trt_min_subgraph_size": (1, None),
    "trt_max_workspace_size": (1, None),
    "trt_dla_core": (0, None),
    "trt_builder_optimization_level": (0, 5),
    "trt_auxiliary_streams": (-1, None),
}
PROFILE_OPTIONS = ("trt_profile_min_shapes", "trt_profile_max_shapes", "trt_profile_opt_shapes")
STRING_OPTIONS = frozenset(
    {
        "trt_int8_calibration_table_name",
        "trt_engine_cache_path",
        "trt_onnx_model_folder_path",
        "trt_engine_cache_prefix",
        "trt_engine_decryption_lib_path",
        "trt_timing_cache_path",
        "trt_tactic_sources",
        "trt_extra_plugin_lib_paths",
        "trt_op_types_to_exclude",
        *PROFILE_OPTIONS,
    }
)
KNOWN_OPTIONS = BOOL_OPTIONS | INT_OPTIONS.keys() | STRING_OPTIONS
CONTEXT_OPTIONS = (
    "trt_dump_ep_context_model",
    "trt_ep_context_file_path",
    "trt_ep_context_embed_mode",
)
POINTER_OPTIONS = (
    "user_compute_stream",
    "has_user_compute_stream",
    "trt_onnx_bytestream",
    "trt_onnx_bytestream_size",
    "trt_external_data_bytestream",
    "trt_external_data_bytestream_size",
)
_REFUSALS: dict[str, tuple[str, str | None]] = {
    **{
        n: (f"{n!r} takes a memory address and cannot be set in a manifest", None)
        for n in POINTER_OPTIONS
    },
    **{
        n: (
            f"{n!r} is set by epbuild",
            "use the group's embed_mode; epbuild chooses the ctx file path",
        )
        for n in CONTEXT_OPTIONS
    },
}
"""Option → message and hint of its refusal."""
SHAPES_RE = re.compile(r"[^:,]+:\d+(x\d+)*(,[^:,]+:\d+(x\d+)*)*")


def _bool(value: str, *, key: str) -> str:
    if value in ("1", "true", "True"):
        return "1"
    if value in ("0", "false", "False"):
        return "0"
    raise ManifestError(f"{value!r} is not a boolean", key=key, hint="use true or false")


def _int(value: str, bounds: tuple[int, int | None], *, key: str) -> str:
    low, high = bounds
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise ManifestError(f"{value!r} is not an integer {span}", key=key)
    return str(number)


@functools.lru_cache(maxsize=1)
def nvidia_gpus() -> str:
    """Models of the NVIDIA GPUs the driver lists, read from /proc without loading CUDA."""
    models: list[str] = []
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Model:"):
                        models.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return "; ".join(sorted(models)) or "none"


def tensorrt_version() -> str:
    """``<dist> <version>`` of the first TensorRT wheel installed, or ``"absent"``."""
    for dist in TENSORRT_DISTS:
        version = dist_version(dist)
        if version != "absent":
            return f"{dist} {version}"
    return "absent"


class TensorRtProvider(BaseProvider):
    """Builds TensorRT engines; needs an NVIDIA GPU, and the engine only runs on its model."""

    kind = "tensorrt"
    extra = "tensorrt"
    ep_dists = (DIST,)
    shares_weights = False
    compile_api = False  # the ctx model comes from its trt_dump_ep_context_model options
    known_options = KNOWN_OPTIONS

    def check_options(self, options: Mapping[str, Any], *, key: str) -> dict[str, str]:
        """Refuse what epbuild sets or a manifest cannot; type-check the rest."""
        refuse_options(options, _REFUSALS, key=key)
        opts = super().check_options(options, key=key)
        for name, value in opts.items():
            if name in BOOL_OPTIONS:
                opts[name] = _bool(value, key=f"{key}.{name}")
            elif name in INT_OPTIONS:
                opts[name] = _int(value, INT_OPTIONS[name], key=f"{key}.{name}")
        given = [name for name in PROFILE_OPTIONS if name in opts]
        if given and len(given) != len(PROFILE_OPTIONS):
            missing = next(name for name in PROFILE_OPTIONS if name not in opts)
            raise ManifestError(
                "trt_profile_min_shapes, trt_profile_max_shapes and trt_profile_opt_shapes "
                "go together",
                key=f"{key}.{missing}",
                hint="give all three, or none and let the EP take the shapes of the model",
            )
        for name in given:
            if not SHAPES_RE.fullmatch(opts[name].replace(" ", "")):
                raise ManifestError(
                    f"{opts[name]!r} is not a shape list",
                    key=f"{key}.{name}",
                    hint='write e.g. "input:1x3x224x224,mask:1x224"',
                )
            opts[name] = opts[name].replace(" ", "")
        cache = opts.get("trt_engine_cache_path")
        if cache is not None and (
            cache.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", cache) or ".." in cache
        ):
            raise ManifestError(
                f"trt_engine_cache_path {cache!r} must be a relative path without '..'",
                key=f"{key}.trt_engine_cache_path",
                hint="the engine lands in this folder beside the ctx model, and the EP refuses "
                "to load a ctx model whose engine path is absolute or leaves its folder",
            )
        return opts

    def versions(self, config: ProviderConfig) -> dict[str, str]:
        return {
            DIST: dist_version(DIST),
            "tensorrt": tensorrt_version(),
            "nvidia-gpus": nvidia_gpus(),
        }

    def context_source(self, config: ProviderConfig) -> str:
        return ""  # the TensorRT EP writes no source attribute

    fixed_ep_name = True
    """Built into onnxruntime-gpu: ``[package] ep_names`` cannot rename it."""

    def package_target(self, config: ProviderConfig) -> tuple[str, str | None]:
        """A TensorRT engine runs on an NVIDIA GPU only."""
        return (EP_NAME, "gpu")

    def context_options(
        self, config: ProviderConfig, ctx_path: str, embed_mode: int
    ) -> dict[str, str]:
        extra = {
            "trt_dump_ep_context_model": "1",
            "trt_ep_context_file_path": ctx_path,
            "trt_ep_context_embed_mode": str(embed_mode),
        }
        if embed_mode == 0:
            extra["trt_engine_cache_enable"] = "1"  # the ctx node points at the cached engine
        return extra

    # compatibility_key: the default None; the EP records the compute capability in the
    # EPContext node's hardware_architecture instead of ep_compatibility_info.

    def attach(
        self, ort: Any, so: SessionOptions, config: ProviderConfig, ep_name: str | None = None
    ) -> None:
        self.refuse_rename(config, ep_name)
        if EP_NAME not in ort.get_available_providers():
            raise ProviderUnavailableError(
                "this onnxruntime has no TensorRT execution provider",
                hint=install_hint(self.extra)
                + " (onnxruntime-gpu replaces onnxruntime; TensorRT needs an NVIDIA GPU)",
            )
        if not hasattr(so, "add_provider"):
            raise ProviderUnavailableError(
                "this onnxruntime cannot add a provider to SessionOptions by name",
                hint="upgrade to onnxruntime-gpu 1.22 or newer",
            )
        so.add_provider(EP_NAME, dict(config.options))
