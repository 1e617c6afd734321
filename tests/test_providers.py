"""Provider adapters: option validation and mapping, versions, attach() against fake ORTs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import waits

from epbuild import providers
from epbuild.errors import ManifestError, ProviderUnavailableError
from epbuild.providers import base, get_provider, known_kinds
from epbuild.providers.base import Provider, ProviderConfig
from epbuild.providers.openvino import OpenVinoProvider
from epbuild.providers.plugin import PluginProvider
from epbuild.providers.qnn import HTP_ARCHS, SOC_MODELS, WELL_KNOWN_TARGETS, QnnProvider
from epbuild.providers.tensorrt import TensorRtProvider

KEY = "providers.x"

# ---------------------------------------------------------------- fakes


class FakeDevice:
    """An OrtEpDevice: ``ep_name``, ``ep_metadata`` and ``device.type.name``."""

    def __init__(self, ep_name: str, hw: str = "NPU", **metadata: str) -> None:
        self.ep_name = ep_name
        self.ep_metadata = metadata
        self.device = types.SimpleNamespace(type=types.SimpleNamespace(name=hw))

    def __repr__(self) -> str:
        return f"FakeDevice({self.ep_name}, {self.device.type.name}, {self.ep_metadata})"


class FakeSessionOptions:
    """Records what an adapter adds."""

    def __init__(self) -> None:
        self.for_devices: list[tuple[list[Any], dict[str, str]]] = []
        self.by_name: list[tuple[str, dict[str, str]]] = []

    def add_provider_for_devices(self, devices: list[Any], options: dict[str, str]) -> None:
        self.for_devices.append((list(devices), dict(options)))

    def add_provider(self, name: str, options: dict[str, str]) -> None:
        self.by_name.append((name, dict(options)))


class FakeOrt:
    """The part of the ``onnxruntime`` module the adapters use."""

    def __init__(self, devices: list[Any] | None = None, available: tuple[str, ...] = ()) -> None:
        self.devices = list(devices or [])
        self.available = ["CPUExecutionProvider", *available]
        self.registered: list[tuple[str, str]] = []

    def register_execution_provider_library(self, name: str, library: str) -> None:
        self.registered.append((name, library))

    def get_ep_devices(self) -> list[Any]:
        return self.devices

    def get_available_providers(self) -> list[str]:
        return self.available


@pytest.fixture(autouse=True)
def _fresh_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_registered", set())


def config(
    adapter: Any, options: dict[str, Any], settings: dict[str, Any] | None = None
) -> ProviderConfig:
    opts, sets = adapter.validate_options(options, settings or {}, key=KEY)
    return ProviderConfig("x", adapter.kind, opts, {}, sets)


def manifest_error(
    adapter: Any, options: dict[str, Any], settings: dict[str, Any] | None = None
) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        adapter.validate_options(options, settings or {}, key=KEY)
    return info.value


# ---------------------------------------------------------------- qnn


def test_qnn_defaults_to_the_htp_backend() -> None:
    cfg = config(QnnProvider(), {"htp_arch": 73, "soc_model": "60"})
    assert dict(cfg.options) == {"backend_type": "htp", "htp_arch": "73", "soc_model": "60"}


def test_qnn_unknown_htp_arch_names_the_key() -> None:
    err = manifest_error(QnnProvider(), {"htp_arch": "99"})
    assert err.key == "providers.x.options.htp_arch"
    assert "99" in err.message and err.hint and "73" in err.hint


def test_qnn_refuses_backend_type_and_backend_path_together() -> None:
    err = manifest_error(QnnProvider(), {"backend_type": "htp", "backend_path": "libQnnHtp.so"})
    assert err.key == "providers.x.options.backend_path"
    assert err.hint and "CPU EP" in err.hint


def test_qnn_backend_path_alone_sets_no_backend_type() -> None:
    cfg = config(QnnProvider(), {"backend_path": "libQnnHtp.so"})
    assert "backend_type" not in cfg.options


def test_qnn_refuses_other_backends_and_unknown_options() -> None:
    assert manifest_error(QnnProvider(), {"backend_type": "cpu"}).key == (
        "providers.x.options.backend_type"
    )
    err = manifest_error(QnnProvider(), {"htp_archh": "73"})
    assert err.key == "providers.x.options.htp_archh"
    assert err.hint and "htp_arch" in err.hint


def test_qnn_multi_soc_lists_are_normalised() -> None:
    adapter = QnnProvider()
    cfg = config(adapter, {"htp_arch": " 73, 75", "soc_model": "60 ,57 "})
    assert cfg.options["htp_arch"] == "73,75"
    assert cfg.options["soc_model"] == "60,57"
    assert adapter.is_multi_soc(cfg)
    assert adapter.check_compatibility(cfg, "anything") is None  # per-SoC info is not checked
    err = manifest_error(adapter, {"htp_arch": "73,75", "soc_model": "60"})
    assert err.key == "providers.x.options.soc_model"


@pytest.mark.parametrize("name", sorted(WELL_KNOWN_TARGETS))
def test_qnn_a_known_chip_with_another_architecture_is_refused(name: str) -> None:
    """Each chip of the table: its own htp_arch passes, every other one names the chip."""
    chip = WELL_KNOWN_TARGETS[name]
    config(QnnProvider(), {"htp_arch": chip.htp_arch, "soc_model": chip.soc_model})
    for arch in sorted(HTP_ARCHS - {chip.htp_arch}):
        err = manifest_error(QnnProvider(), {"htp_arch": arch, "soc_model": chip.soc_model})
        assert err.key == "providers.x.options.soc_model"
        assert chip.title in err.message and f"HTP v{chip.htp_arch}" in err.message
        assert err.hint and f'htp_arch = "{chip.htp_arch}"' in err.hint


def test_qnn_a_chip_pairing_is_checked_per_target_of_a_multi_soc_list() -> None:
    config(QnnProvider(), {"htp_arch": "73,79", "soc_model": "60,69"})
    err = manifest_error(QnnProvider(), {"htp_arch": "73,75", "soc_model": "60,69"})
    assert "Snapdragon 8 Elite" in err.message and "HTP v79" in err.message
    assert err.hint and 'soc_model = "57"' in err.hint  # the v75 chip the table knows


def test_qnn_a_soc_model_the_sdk_knows_and_the_table_does_not_is_accepted() -> None:
    unnamed = sorted(SOC_MODELS - {t.soc_model for t in WELL_KNOWN_TARGETS.values()}, key=int)
    assert unnamed
    for soc in unnamed:
        for arch in HTP_ARCHS:
            config(QnnProvider(), {"htp_arch": arch, "soc_model": soc})


def test_qnn_refuses_settings_and_nested_values() -> None:
    assert manifest_error(QnnProvider(), {}, {"library": "x.so"}).key == "providers.x.library"
    err = manifest_error(QnnProvider(), {"htp_arch": ["73"]})
    assert err.key == "providers.x.options.htp_arch"


def test_qnn_compatibility_string_is_checked_against_the_target() -> None:
    adapter = QnnProvider()
    cfg = config(adapter, {"htp_arch": "73", "soc_model": "60"})
    assert adapter.compatibility_key(cfg) == "QNNExecutionProvider"
    assert adapter.context_source(cfg) == "QNNExecutionProvider"
    assert adapter.context_options(cfg, "out/a_ctx.onnx", 0) == {}
    assert adapter.check_compatibility(cfg, "v2:6:2.51.0:5.51.0:73:60:0:0") is None
    message = adapter.check_compatibility(cfg, "v2:6:2.51.0:5.51.0:75:69:0:0")
    assert message and "75" in message
    assert adapter.check_compatibility(cfg, "garbage")


def test_qnn_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # import raises ImportError
    cfg = config(QnnProvider(), {"htp_arch": "73"})
    with pytest.raises(ProviderUnavailableError) as info:
        QnnProvider().attach(FakeOrt(), FakeSessionOptions(), cfg)
    assert "epbuild[qnn]" in str(info.value)


def _fake_qnn_module(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("onnxruntime_qnn")
    module.get_library_path = lambda: "/site/onnxruntime_qnn/libonnxruntime_providers_qnn.so"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", module)


def test_qnn_without_devices_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_qnn_module(monkeypatch)
    cfg = config(QnnProvider(), {"htp_arch": "73"})
    with pytest.raises(ProviderUnavailableError) as info:
        QnnProvider().attach(FakeOrt([]), FakeSessionOptions(), cfg)
    assert "epbuild[qnn]" in (info.value.hint or "")


def test_qnn_attach_registers_once_and_adds_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_qnn_module(monkeypatch)
    qnn = FakeDevice("QNNExecutionProvider")
    ort = FakeOrt([FakeDevice("CPUExecutionProvider", "CPU"), qnn])
    cfg = config(QnnProvider(), {"htp_arch": "73"})
    for _ in range(2):
        so = FakeSessionOptions()
        QnnProvider().attach(ort, so, cfg)
        assert so.for_devices == [([qnn], dict(cfg.options))]
    assert len(ort.registered) == 1 and ort.registered[0][0] == "QNNExecutionProvider"


# ---------------------------------------------------------------- plugin


def test_plugin_requires_library_and_ep_name() -> None:
    assert manifest_error(PluginProvider(), {}, {"ep_name": "MyEP"}).key == "providers.x.library"
    assert manifest_error(PluginProvider(), {}, {"library": "a.so"}).key == "providers.x.ep_name"
    assert manifest_error(PluginProvider(), {}, {"library": "", "ep_name": "e"}).key == (
        "providers.x.library"
    )


def test_plugin_settings_are_checked_and_options_pass_through() -> None:
    settings = {"library": "libs/libmy.so", "ep_name": "MyEP", "device_type": "NPU"}
    cfg = config(PluginProvider(), {"any_key": True, "level": 3, "mode": "fast"}, settings)
    assert dict(cfg.options) == {"any_key": "1", "level": "3", "mode": "fast"}
    assert dict(cfg.settings) == {
        "library": "libs/libmy.so", "ep_name": "MyEP", "device_type": "npu", "source": "MyEP",
    }  # fmt: skip
    adapter = PluginProvider()
    assert adapter.context_source(cfg) == "MyEP"
    assert adapter.compatibility_key(cfg) == "MyEP"
    assert adapter.check_compatibility(cfg, "whatever") is None
    assert adapter.context_options(cfg, "out/a_ctx.onnx", 1) == {}
    cfg2 = config(adapter, {}, {"library": "a.so", "ep_name": "MyEP", "source": "my"})
    assert adapter.context_source(cfg2) == "my"


def test_plugin_refuses_bad_settings() -> None:
    base_settings = {"library": "a.so", "ep_name": "E"}
    err = manifest_error(PluginProvider(), {}, {**base_settings, "device_type": "tpu"})
    assert err.key == "providers.x.device_type"
    err = manifest_error(PluginProvider(), {}, {**base_settings, "libary": "b.so"})
    assert err.key == "providers.x.libary"
    err = manifest_error(PluginProvider(), {}, {**base_settings, "source": 3})
    assert err.key == "providers.x.source"


def test_plugin_versions_follow_the_library_bytes(tmp_path: Path) -> None:
    lib = tmp_path / "libmy.so"
    cfg = config(PluginProvider(), {}, {"library": str(lib), "ep_name": "E"})
    assert PluginProvider().versions(cfg)["plugin-library"] == "absent"
    lib.write_bytes(b"one")
    first = PluginProvider().versions(cfg)
    assert len(first["plugin-library"]) == 16
    assert all(isinstance(v, str) for v in first.values())
    lib.write_bytes(b"two!")
    assert PluginProvider().versions(cfg)["plugin-library"] != first["plugin-library"]


def test_plugin_missing_library_says_to_install_the_ep(tmp_path: Path) -> None:
    cfg = config(PluginProvider(), {}, {"library": str(tmp_path / "no.so"), "ep_name": "E"})
    with pytest.raises(ProviderUnavailableError) as info:
        PluginProvider().attach(FakeOrt(), FakeSessionOptions(), cfg)
    assert "EP's own package" in (info.value.hint or "")


def test_plugin_attach_filters_devices_by_name_and_type(tmp_path: Path) -> None:
    lib = tmp_path / "libmy.so"
    lib.write_bytes(b"elf")
    settings = {"library": str(lib), "ep_name": "MyEP", "device_type": "gpu"}
    cfg = config(PluginProvider(), {"opt": 1}, settings)
    gpu = FakeDevice("MyEP", "GPU")
    ort = FakeOrt([FakeDevice("MyEP", "NPU"), gpu, FakeDevice("Other", "GPU")])
    so = FakeSessionOptions()
    PluginProvider().attach(ort, so, cfg)
    assert ort.registered == [("MyEP", str(lib))]
    assert so.for_devices == [([gpu], {"opt": "1"})]
    with pytest.raises(ProviderUnavailableError) as info:
        PluginProvider().attach(FakeOrt([]), FakeSessionOptions(), cfg)
    assert "epbuild[" not in str(info.value)


# ---------------------------------------------------------------- openvino


def test_openvino_device_type_defaults_to_npu_and_is_normalised() -> None:
    assert config(OpenVinoProvider(), {}).options["device_type"] == "NPU"
    assert config(OpenVinoProvider(), {"device_type": "gpu.1"}).options["device_type"] == "GPU.1"


@pytest.mark.parametrize("device", ["AUTO:NPU,CPU", "HETERO:GPU,CPU", "CPU_FP32", "TPU", "NPU.x"])
def test_openvino_refuses_devices_that_cannot_compile(device: str) -> None:
    err = manifest_error(OpenVinoProvider(), {"device_type": device})
    assert err.key == "providers.x.options.device_type"
    assert err.hint


def test_openvino_refuses_unknown_and_ignored_options() -> None:
    err = manifest_error(OpenVinoProvider(), {"device_typ": "NPU"})
    assert err.key == "providers.x.options.device_typ"
    err = manifest_error(OpenVinoProvider(), {"precision": "FP16"})
    assert err.key == "providers.x.options.precision"
    assert err.hint and "load_config" in err.hint and "INFERENCE_PRECISION_HINT" in err.hint
    for name in ("cache_dir", "device_id", "disable_dynamic_shapes"):
        assert manifest_error(OpenVinoProvider(), {name: "x"}).key == f"providers.x.options.{name}"
    assert manifest_error(OpenVinoProvider(), {}, {"library": "a"}).key == "providers.x.library"


def test_openvino_load_config_becomes_canonical_json() -> None:
    table = {"NPU": {"NPU_QDQ_OPTIMIZATION": "YES", "A": 1}}
    from_table = config(OpenVinoProvider(), {"load_config": table}).options["load_config"]
    text = json.dumps({"NPU": {"A": 1, "NPU_QDQ_OPTIMIZATION": "YES"}}, indent=2)
    from_text = config(OpenVinoProvider(), {"load_config": text}).options["load_config"]
    assert from_table == from_text == '{"NPU":{"A":1,"NPU_QDQ_OPTIMIZATION":"YES"}}'


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ({"XPU": {}}, "providers.x.options.load_config.XPU"),
        ({"NPU": "YES"}, "providers.x.options.load_config.NPU"),
        ("{not json", "providers.x.options.load_config"),
        ("[1]", "providers.x.options.load_config"),
    ],
)
def test_openvino_refuses_bad_load_config(value: Any, key: str) -> None:
    assert manifest_error(OpenVinoProvider(), {"load_config": value}).key == key


def test_openvino_booleans_are_true_false() -> None:
    cfg = config(OpenVinoProvider(), {"enable_causallm": True, "dump_subgraphs": "False"})
    assert cfg.options["enable_causallm"] == "true"
    assert cfg.options["dump_subgraphs"] == "false"
    err = manifest_error(OpenVinoProvider(), {"enable_causallm": "1"})
    assert err.key == "providers.x.options.enable_causallm"


def test_openvino_reshape_input_is_a_shape_list() -> None:
    ok = "input_ids[1,128],attention_mask[1..8,128]"
    assert config(OpenVinoProvider(), {"reshape_input": ok}).options["reshape_input"] == ok
    err = manifest_error(OpenVinoProvider(), {"reshape_input": "input_ids:1x128"})
    assert err.key == "providers.x.options.reshape_input"


def test_openvino_describes_its_context(tmp_path: Path) -> None:
    from epbuild.providers.base import scanning

    adapter = OpenVinoProvider()
    cfg = config(adapter, {})
    assert adapter.shares_weights
    assert adapter.sharing_refusal(cfg) is None  # the NPU shares
    assert adapter.context_source(cfg) == "OpenVINOExecutionProvider"
    assert adapter.context_options(cfg, "a_ctx.onnx", 0) == {}
    # Only the plugin EP writes compatibility info; the EP built into onnxruntime-openvino
    # does not. Which one is installed is read from the environment being looked at.
    plugin, builtin = tmp_path / "plugin", tmp_path / "builtin"
    (plugin / "onnxruntime_ep_openvino-1.8.1.dist-info").mkdir(parents=True)
    (builtin / "onnxruntime_openvino-1.24.1.dist-info").mkdir(parents=True)
    with scanning((str(plugin),)):
        assert adapter.compatibility_key(cfg) == "OpenVINOExecutionProvider"
    with scanning((str(builtin),)):
        assert adapter.compatibility_key(cfg) is None


def test_openvino_refuses_sharing_on_cpu() -> None:
    adapter = OpenVinoProvider()
    why = adapter.sharing_refusal(config(adapter, {"device_type": "CPU"}))
    assert why is not None and "does not share weights on CPU" in why


def _fake_openvino_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("onnxruntime_ep_openvino")
    module.get_ep_name = lambda: "OpenVINOExecutionProvider"  # type: ignore[attr-defined]
    module.get_library_path = lambda: "/site/ov/libonnxruntime_providers_openvino_plugin.so"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_openvino", module)


def test_openvino_plugin_picks_the_device_from_device_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_openvino_plugin(monkeypatch)
    ov = "OpenVINOExecutionProvider"
    cpu = FakeDevice(ov, "CPU", ov_device="CPU")
    gpu0 = FakeDevice(ov, "GPU", ov_device="GPU.0")
    gpu1 = FakeDevice(ov, "GPU", ov_device="GPU.1")
    npu = FakeDevice(ov, "NPU", ov_device="NPU")
    ort = FakeOrt([FakeDevice("CPUExecutionProvider", "CPU"), cpu, gpu0, gpu1, npu])
    cases = [({}, npu), ({"device_type": "GPU"}, gpu0), ({"device_type": "GPU.1"}, gpu1)]
    for options, expected in cases:
        cfg = config(OpenVinoProvider(), {**options, "enable_causallm": True})
        so = FakeSessionOptions()
        OpenVinoProvider().attach(ort, so, cfg)
        # device selection is by device; the plugin would only log a device_type option
        assert so.for_devices == [([expected], {"enable_causallm": "true"})]
    assert ort.registered == [(ov, "/site/ov/libonnxruntime_providers_openvino_plugin.so")]


def test_openvino_without_an_intel_device_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_openvino_plugin(monkeypatch)
    ort = FakeOrt([FakeDevice("CPUExecutionProvider", "CPU")])  # an AMD CPU lists nothing
    with pytest.raises(ProviderUnavailableError) as info:
        OpenVinoProvider().attach(ort, FakeSessionOptions(), config(OpenVinoProvider(), {}))
    assert "NPU" in info.value.message
    assert "epbuild[openvino]" in (info.value.hint or "")


def test_openvino_falls_back_to_the_built_in_ep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_openvino", None)
    ort = FakeOrt(available=("OpenVINOExecutionProvider",))
    so = FakeSessionOptions()
    OpenVinoProvider().attach(ort, so, config(OpenVinoProvider(), {"device_type": "cpu"}))
    assert so.by_name == [("OpenVINOExecutionProvider", {"device_type": "CPU"})]


def test_openvino_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime_ep_openvino", None)
    with pytest.raises(ProviderUnavailableError) as info:
        OpenVinoProvider().attach(FakeOrt(), FakeSessionOptions(), config(OpenVinoProvider(), {}))
    assert 'pip install "epbuild[openvino]"' in str(info.value)


# ---------------------------------------------------------------- tensorrt


@pytest.mark.parametrize(
    "name",
    [
        "trt_dump_ep_context_model", "trt_ep_context_file_path", "trt_ep_context_embed_mode",
        "user_compute_stream", "trt_onnx_bytestream", "trt_no_such_option",
    ],
)  # fmt: skip
def test_tensorrt_refuses_keys_the_build_owns_or_does_not_know(name: str) -> None:
    err = manifest_error(TensorRtProvider(), {name: "1"})
    assert err.key == f"providers.x.options.{name}"


def test_tensorrt_normalises_booleans_and_integers() -> None:
    options = {"trt_fp16_enable": True, "trt_int8_enable": "false", "device_id": "0",
               "trt_builder_optimization_level": 5, "trt_auxiliary_streams": -1}  # fmt: skip
    cfg = config(TensorRtProvider(), options)
    assert dict(cfg.options) == {
        "trt_fp16_enable": "1", "trt_int8_enable": "0", "device_id": "0",
        "trt_builder_optimization_level": "5", "trt_auxiliary_streams": "-1",
    }  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"trt_fp16_enable": "yes"},
        {"trt_builder_optimization_level": 6},
        {"device_id": -1},
        {"trt_max_workspace_size": "2GB"},
    ],
)
def test_tensorrt_refuses_bad_values(options: dict[str, Any]) -> None:
    (name,) = options
    assert manifest_error(TensorRtProvider(), options).key == f"providers.x.options.{name}"


def test_tensorrt_profile_shapes_go_together() -> None:
    err = manifest_error(TensorRtProvider(), {"trt_profile_min_shapes": "x:1x3"})
    assert err.key == "providers.x.options.trt_profile_max_shapes"
    shapes = {
        "trt_profile_min_shapes": "x:1x3, m:1",
        "trt_profile_max_shapes": "x:8x3,m:8",
        "trt_profile_opt_shapes": "x:4x3,m:4",
    }
    assert config(TensorRtProvider(), shapes).options["trt_profile_min_shapes"] == "x:1x3,m:1"
    bad = {**shapes, "trt_profile_opt_shapes": "x[4,3]"}
    assert (
        manifest_error(TensorRtProvider(), bad).key == "providers.x.options.trt_profile_opt_shapes"
    )


@pytest.mark.parametrize("path", ["/abs/engines", "../engines", "C:/engines"])
def test_tensorrt_engine_cache_path_stays_beside_the_ctx_model(path: str) -> None:
    err = manifest_error(TensorRtProvider(), {"trt_engine_cache_path": path})
    assert err.key == "providers.x.options.trt_engine_cache_path"
    assert config(TensorRtProvider(), {"trt_engine_cache_path": "engines"}).options


def test_tensorrt_context_options_drive_its_own_dump() -> None:
    adapter = TensorRtProvider()
    cfg = config(adapter, {"trt_fp16_enable": True})
    assert adapter.context_options(cfg, "stage/a_ctx.onnx", 0) == {
        "trt_dump_ep_context_model": "1",
        "trt_ep_context_file_path": "stage/a_ctx.onnx",
        "trt_ep_context_embed_mode": "0",
        "trt_engine_cache_enable": "1",
    }
    embedded = adapter.context_options(cfg, "stage/a_ctx.onnx", 1)
    assert embedded["trt_ep_context_embed_mode"] == "1"
    assert "trt_engine_cache_enable" not in embedded
    assert adapter.context_source(cfg) == ""
    assert adapter.compatibility_key(cfg) is None
    assert not adapter.shares_weights


def test_tensorrt_missing_ep_names_the_extra() -> None:
    cfg = config(TensorRtProvider(), {})
    with pytest.raises(ProviderUnavailableError) as info:
        TensorRtProvider().attach(FakeOrt(), FakeSessionOptions(), cfg)
    assert 'pip install "epbuild[tensorrt]"' in str(info.value)


def test_tensorrt_attach_adds_the_ep_by_name() -> None:
    adapter = TensorRtProvider()
    cfg = config(adapter, {"trt_fp16_enable": True})
    merged = ProviderConfig(
        "x", "tensorrt", {**cfg.options, **adapter.context_options(cfg, "s/a_ctx.onnx", 1)}
    )
    so = FakeSessionOptions()
    adapter.attach(FakeOrt(available=("TensorrtExecutionProvider",)), so, merged)
    assert so.by_name == [("TensorrtExecutionProvider", dict(merged.options))]


# ---------------------------------------------------------------- versions (no imports)

VERSIONS_SCRIPT = """
import json, sys
from epbuild.providers import get_provider
from epbuild.providers.base import ProviderConfig
configs = {
    "qnn": ({"htp_arch": "73"}, {}),
    "plugin": ({}, {"library": "nowhere/libx.so", "ep_name": "X"}),
    "openvino": ({}, {}),
    "tensorrt": ({}, {}),
}
out = {}
for kind, (options, settings) in configs.items():
    adapter = get_provider(kind)
    opts, sets = adapter.validate_options(options, settings, key="providers.x")
    out[kind] = adapter.versions(ProviderConfig("x", kind, opts, {}, sets))
imported = sorted(m for m in sys.modules if m.split(".")[0] in (
    "onnxruntime", "onnxruntime_qnn", "onnxruntime_ep_openvino", "openvino", "tensorrt", "onnx"))
print(json.dumps({"versions": out, "imported": imported}))
"""


def test_versions_are_strings_read_without_importing_any_ep() -> None:
    proc = waits.run([sys.executable, "-c", VERSIONS_SCRIPT], "the versions script")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["imported"] == []
    versions = result["versions"]
    for kind, table in versions.items():
        assert table and all(isinstance(v, str) and v for v in table.values()), kind
    assert set(versions["qnn"]) == {"onnxruntime", "onnxruntime-qnn", "qnn-sdk"}
    assert versions["plugin"]["plugin-library"] == "absent"
    assert {"onnxruntime-ep-openvino", "onnxruntime-openvino", "openvino"} <= set(
        versions["openvino"]
    )
    assert {"onnxruntime-gpu", "tensorrt", "nvidia-gpus"} <= set(versions["tensorrt"])


# ---------------------------------------------------------------- registry


def test_builtin_kinds_are_singletons_implementing_the_protocol() -> None:
    assert known_kinds()[:4] == ["qnn", "plugin", "openvino", "tensorrt"]
    expected = {"qnn": QnnProvider, "plugin": PluginProvider, "openvino": OpenVinoProvider,
                "tensorrt": TensorRtProvider}  # fmt: skip
    for kind, cls in expected.items():
        adapter: Provider = get_provider(kind)
        assert isinstance(adapter, cls)
        assert adapter is get_provider(kind)
        assert adapter.kind == kind
        assert all(hasattr(adapter, name) for name in providers._REQUIRED)


def test_builtin_kinds_never_scan_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(**_: Any) -> Any:
        raise AssertionError("entry points scanned on the built-in path")

    monkeypatch.setattr(importlib.metadata, "entry_points", boom)
    for kind in ("qnn", "plugin", "openvino", "tensorrt"):
        monkeypatch.delitem(providers._cache, kind, raising=False)
        assert get_provider(kind).kind == kind


def test_unknown_kind_lists_the_known_ones() -> None:
    with pytest.raises(ManifestError) as info:
        get_provider("cuda")
    assert "unknown provider adapter 'cuda'" in info.value.message
    assert info.value.hint and "known: qnn, plugin, openvino, tensorrt" in info.value.hint


class ThirdParty(base.BaseProvider):
    """A minimal adapter a third-party package could ship."""

    kind = "acme"
    extra = ""
    shares_weights = False

    def versions(self, config: ProviderConfig) -> dict[str, str]:
        return {}

    def context_source(self, config: ProviderConfig) -> str:
        return "acme"

    def attach(self, ort: Any, so: Any, config: ProviderConfig, ep_name: str | None = None) -> None:
        return None


class FakeEntryPoint:
    def __init__(self, name: str, target: Any) -> None:
        self.name = name
        self.value = f"acme.adapters:{name}"
        self.target = target

    def load(self) -> Any:
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def test_third_party_adapters_come_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    points = [FakeEntryPoint("acme", ThirdParty)]
    monkeypatch.setattr(providers, "_entry_points", lambda: points)
    monkeypatch.setattr(providers, "_cache", {})
    adapter = get_provider("acme")
    assert isinstance(adapter, ThirdParty)
    assert adapter is get_provider("acme")
    assert known_kinds() == ["qnn", "plugin", "openvino", "tensorrt", "acme"]


@pytest.mark.parametrize(
    ("target", "words"),
    [
        (ImportError("no module acme"), "could not be loaded"),
        (object(), "lacks"),
        (type("Other", (ThirdParty,), {"kind": "other"}), "says its kind is 'other'"),
    ],
)
def test_broken_third_party_adapters_are_manifest_errors(
    monkeypatch: pytest.MonkeyPatch, target: Any, words: str
) -> None:
    monkeypatch.setattr(providers, "_entry_points", lambda: [FakeEntryPoint("acme", target)])
    monkeypatch.setattr(providers, "_cache", {})
    with pytest.raises(ManifestError) as info:
        get_provider("acme")
    assert words in info.value.message


def test_base_provider_gives_an_adapter_its_defaults() -> None:
    class Tiny(base.BaseProvider):
        kind = "tiny"

        def versions(self, config: ProviderConfig) -> dict[str, str]:
            return {}

        def context_source(self, config: ProviderConfig) -> str:
            return "tiny"

        def attach(
            self, ort: Any, so: Any, config: ProviderConfig, ep_name: str | None = None
        ) -> None:
            return None

    tiny: Provider = Tiny()
    assert all(hasattr(tiny, name) for name in providers._REQUIRED)
    assert tiny.validate_options({"a": True, "b": 2}, {}, key=KEY) == ({"a": "1", "b": "2"}, {})
    with pytest.raises(ManifestError) as info:
        tiny.validate_options({}, {"library": "x.so"}, key=KEY)
    assert info.value.key == f"{KEY}.library" and "setting of the tiny provider" in str(info.value)
    cfg = ProviderConfig("x", "tiny", {})
    assert tiny.context_options(cfg, "out_ctx.onnx", 0) == {}
    assert tiny.compatibility_key(cfg) is None and tiny.check_compatibility(cfg, "i") is None


def test_an_adapter_written_from_the_documentation_builds(tmp_path: Path) -> None:
    """docs/providers.md's example adapter, installed as a package with an entry point,
    compiles a model with the real QNN plugin; nothing but the documentation is used."""
    import re
    import subprocess
    import sys

    from conftest import Workspace

    doc = (Path(__file__).parent.parent / "docs" / "providers.md").read_text()
    section = doc[doc.index("### Writing an adapter") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    site = tmp_path / "site"
    (site / "acme_epbuild-1.0.dist-info").mkdir(parents=True)
    (site / "acme_epbuild.py").write_text(code.group(1))
    (site / "acme_epbuild-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-epbuild\nVersion: 1.0\n"
    )
    (site / "acme_epbuild-1.0.dist-info" / "entry_points.txt").write_text(
        "[epbuild.providers]\nacme = acme_epbuild:AcmeQnn\n"
    )
    ws = Workspace(tmp_path / "ws")
    ws.model("m/a.onnx")
    ws.manifest({"providers": {"npu": {"ep": "acme", "options": {
        "backend_type": "htp", "htp_arch": "73", "soc_model": "60"}}},
        "groups": {"g": {"models": ["m/a.onnx"], "providers": ["npu"]}}})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(site), "EPBUILD_CACHE": "off"}
    run = [sys.executable, "-m", "epbuild", "-C", str(ws.root)]
    built = subprocess.run([*run, "build"], capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (ws.root / "build/g/npu/a_ctx.onnx").is_file()
    checked = subprocess.run([*run, "verify"], capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
