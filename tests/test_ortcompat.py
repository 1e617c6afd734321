"""ONNX Runtime's own compatibility verdict: read for real, and "not available" wherever ORT,
the EP or the model cannot give one (never an exception)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import HTP73, Workspace
from modelgen import matmul_model

from epbuild.inspection.ortcompat import OrtVerdict, ort_compatibility
from epbuild.onnx.context import Severity
from epbuild.providers.base import ProviderConfig

QNN = ProviderConfig("htp", "qnn", {"backend_type": "htp", **HTP73["options"]})


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = Workspace(tmp_path_factory.mktemp("ortcompat") / "ws")
    ws.model("m/a.onnx", matmul_model(1))
    ws.manifest({"providers": {"htp": HTP73}, "groups": {"g": {
        "models": ["m/a.onnx"], "providers": ["htp"]}}})  # fmt: skip
    assert ws.build().ok
    return ws.root / "build/g/htp/a_ctx.onnx"


def test_path_and_bytes_read_the_same_info(ctx: Path) -> None:
    by_path = ort_compatibility("a", ctx, QNN)
    by_bytes = ort_compatibility("a", "elsewhere", QNN, ctx.read_bytes())
    assert by_path.info == by_bytes.info and (by_path.info or "").startswith("v2:6:")
    # onnxruntime-qnn judges only NPU devices; this host lists a CPU-typed QNN device
    assert by_path.verdict is None and by_path.problem() is None
    assert by_path.note == (
        "the QNNExecutionProvider EP judges only NPU devices and this machine lists none"
    )


def test_the_qnn_ep_is_never_asked_without_an_npu(
    ctx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Asked after a QNN session existed in the process, its refusal segfaults (ORT 1.32).
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    def judge(devices: object, info: str) -> None:
        raise AssertionError("asked")

    monkeypatch.setattr(capi, "get_model_compatibility_for_ep_devices", judge)
    assert ort_compatibility("a", ctx, QNN).verdict is None


def test_a_model_without_compatibility_info(ctx: Path) -> None:
    plain = ort_compatibility("m", ctx.parents[3] / "m/a.onnx", QNN)
    assert plain.verdict is None and "no ep_compatibility_info.QNNExecutionProvider" in plain.note


def test_no_compatibility_api_in_this_onnxruntime(
    ctx: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    monkeypatch.delattr(capi, "get_model_compatibility_for_ep_devices")
    found = ort_compatibility("a", ctx, QNN)
    assert found.verdict is None and "has no compatibility API" in found.note


def test_an_ep_that_records_no_info(ctx: Path) -> None:
    trt = ProviderConfig("trt", "tensorrt", {})
    found = ort_compatibility("a", ctx, trt)
    assert found.verdict is None and "records no compatibility info" in found.note


def test_an_unreadable_model(tmp_path: Path) -> None:
    bad = tmp_path / "bad_ctx.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    found = ort_compatibility("bad", bad, QNN)
    assert found.verdict is None and found.note


@pytest.mark.parametrize(
    ("verdict", "severity"),
    [
        (OrtVerdict.EP_UNSUPPORTED, Severity.ERROR),
        (OrtVerdict.EP_SUPPORTED_PREFER_RECOMPILATION, Severity.WARNING),
        (OrtVerdict.EP_SUPPORTED_OPTIMAL, None),
        (OrtVerdict.EP_NOT_APPLICABLE, None),
    ],
)
def test_what_each_verdict_means(
    ctx: Path, monkeypatch: pytest.MonkeyPatch, verdict: OrtVerdict, severity: Severity | None
) -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as capi

    from epbuild.providers.qnn import QnnProvider

    monkeypatch.setattr(QnnProvider, "compatibility_device_types", frozenset({"CPU"}))
    answer = getattr(capi.OrtCompiledModelCompatibility, verdict.value)
    monkeypatch.setattr(capi, "get_model_compatibility_for_ep_devices", lambda d, i: answer)
    found = ort_compatibility("a", ctx, QNN)
    problem = found.problem()
    assert found.verdict is verdict and found.to_json()["verdict"] == verdict.value
    assert (problem.severity if problem else None) is severity
