"""``verify --numerics`` for OpenVINO CPU blobs, which the onnxruntime-openvino Linux wheel
cannot load: the blob is unwrapped and run with the standalone ``openvino`` package.

The slow tests make real toolchains with pip in the per-user toolchain directory (once per
machine): onnxruntime-openvino alone, and with the ``openvino`` package beside it.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
from conftest import Workspace
from modelgen import matmul_model

from epbuild.cache.location import default_cache_dir
from epbuild.inspection.ovblob import MAGIC, BlobError, bson, unwrap
from epbuild.inspection.verify import verify_outputs
from epbuild.results import CheckStatus

CORPUS = Path(__file__).parent / "corpus"
OPENVINO_PIN = "onnxruntime-openvino==1.24.1"
STANDALONE_PIN = "openvino==2025.4.1"
"""The OpenVINO the wheel bundles (its blobs say ``ep_sdk_version = "2025.4"``)."""


def _bson(doc: dict[str, object]) -> bytes:
    body = b""
    for key, value in doc.items():
        name = key.encode() + b"\0"
        if isinstance(value, dict):
            body += b"\x03" + name + _bson(value)
        elif isinstance(value, str):
            text = value.encode() + b"\0"
            body += b"\x02" + name + struct.pack("<i", len(text)) + text
        else:
            assert isinstance(value, int)
            body += b"\x12" + name + struct.pack("<q", value)
    return struct.pack("<i", len(body) + 5) + body + b"\0"


def _container(blobs: dict[str, bytes]) -> bytes:
    """An OVEP_BIN file as the EP writes it: header, BSON map, 64 KiB-aligned blobs."""
    offset, table, data = 65536, {}, b""
    for name, blob in blobs.items():
        table[name] = {"data_offset": offset + len(data), "size": len(blob)}
        data += blob.ljust(65536, b"\0")
    doc = _bson({"blob_metadata_map": table, "producer": "test", "version": "1.0.0"})
    head = struct.pack("<8sQQQQ", MAGIC, 1, 40, 40, len(doc)) + doc
    return head.ljust(offset, b"\0") + data


def test_unwrap_finds_each_partition() -> None:
    data = _container({"p1": b"<cnndata>one", "p2": b"<cnndata>two"})
    assert unwrap(data, "p1") == b"<cnndata>one" and unwrap(data, "p2") == b"<cnndata>two"
    assert bson(data[40:])["producer"] == "test"


@pytest.mark.parametrize(
    ("mangle", "needle"),
    [
        (lambda d: b"NOT_OVEP" + d[8:], "OVEP_BIN header"),
        (lambda d: d[:40] + b"\xff" * 8 + d[48:], "not valid BSON"),
        (lambda d: d[:70000], "outside the file"),
        (lambda d: d.replace(b"p1", b"p9"), "no blob for partition 'p1'"),
    ],
)
def test_a_damaged_container_is_a_clear_failure(mangle: object, needle: str) -> None:
    data = _container({"p1": b"<cnndata>" + b"x" * 10000})
    with pytest.raises(BlobError, match=needle):
        unwrap(mangle(data), "p1")  # type: ignore[operator]


@pytest.fixture
def real_toolchains(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make and reuse toolchains in the per-user directory (slow to make, cheap to keep)."""
    root = os.environ.get("EPBUILD_TOOLCHAINS") or os.path.join(default_cache_dir(), "toolchains")
    monkeypatch.setenv("EPBUILD_TOOLCHAINS", root)
    return root


def _openvino_workspace(ws: Workspace, requirements: list[str]) -> None:
    ws.model("m/mlp.onnx", matmul_model(3))
    ws.model("other/mlp.onnx", matmul_model(4))  # same names and shapes, other weights
    shutil.copy(CORPUS / "cnn_torchscript.onnx", ws.root / "m" / "cnn.onnx")
    provider = {"ep": "openvino", "options": {"device_type": "CPU"},
                "toolchain": {"requirements": requirements}}  # fmt: skip
    ws.manifest({"providers": {"intel-cpu": provider}, "groups": {
        "g": {"models": ["m/mlp.onnx", "m/cnn.onnx"], "providers": ["intel-cpu"]},
        "other": {"models": ["other/mlp.onnx"], "providers": ["intel-cpu"]}}})  # fmt: skip
    assert ws.build().ok


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_openvino_cpu_blobs_are_checked_with_the_openvino_package(
    workspace: Workspace, real_toolchains: str
) -> None:
    _openvino_workspace(workspace, [OPENVINO_PIN, STANDALONE_PIN])
    result = verify_outputs(workspace.root, selectors=["g"], numerics=True)
    checks = {c.model: c for c in result.numerics}
    assert len(checks) == 2 and result.ok
    for stem in ("mlp", "cnn"):
        check = checks[f"build/g/intel-cpu/{stem}_ctx.onnx"]
        assert check.status is CheckStatus.OK, check.reason
        assert "standalone openvino 2025.4.1" in check.reason
        # OpenVINO's CPU plugin at fp32 against ORT's CPU EP: rounding only
        assert check.tolerance is not None and check.tolerance.rtol == 1e-3
        assert check.outputs
        for out in check.outputs:
            assert out["max_rel"] < 1e-4 and out["cosine"] > 0.99999, out
    detail = workspace.cli("status", "--detail", "g", check=True).stdout
    assert "numerics: ok (worst output" in detail and "standalone openvino 2025.4.1" in detail
    # The blob is what runs: this model's blob against the other mlp's source (same names
    # and shapes, other weights) gives figures far beyond any tolerance.
    from epbuild.inspection.loading import LoadOutcome, _run_loader
    from epbuild.toolchains import create
    from epbuild.toolchains.spec import ToolchainSpec

    spec = ToolchainSpec(requirements=(OPENVINO_PIN, STANDALONE_PIN))
    toolchain = create.ensure(spec, "intel-cpu")
    ctx = "build/g/intel-cpu/mlp_ctx.onnx"
    job = {"ctx": ctx, "source": "other/mlp.onnx", "provider": {"name": "intel-cpu"}}
    wrong = _run_loader(str(workspace.root), ctx, job, toolchain, "epbuild.inspection.ovblob")
    assert wrong.outcome is LoadOutcome.PASSED and wrong.outputs, wrong
    (out,) = wrong.outputs
    assert out["name"] == "y" and out["max_rel"] > 0.1 and out["cosine"] < 0.9, out


@pytest.mark.slow  # makes (or reuses) a real toolchain environment with pip
def test_without_the_openvino_package_it_says_how_to_enable_the_check(
    workspace: Workspace, real_toolchains: str
) -> None:
    _openvino_workspace(workspace, [OPENVINO_PIN])
    result = verify_outputs(workspace.root, numerics=True)
    assert result.numerics
    for check in result.numerics:
        assert check.status is CheckStatus.NOT_CHECKABLE
        assert "IR frontend" in check.reason
        assert (
            'add "openvino==2025.4.*" to the toolchain requirements of provider '
            "'intel-cpu'" in check.reason
        )
