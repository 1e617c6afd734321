"""Odd but valid models, and files that only pass for models, from real exporters
(``tests/corpus``) through the whole flow: each user mistake is one message naming the
file and what to do (never a traceback), and what builds verifies and packages.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import HTP73, Workspace
from onnx import TensorProto, numpy_helper

CORPUS = Path(__file__).parent / "corpus"


def _external_cnn(ws: Workspace, rel: str, location: str) -> Path:
    """The corpus CNN at ``rel`` with every tensor in the external-data file ``location``."""
    path = ws.root / rel
    (path.parent / location).parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(CORPUS / "cnn_torchscript.onnx")
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location=location, size_threshold=0)  # fmt: skip
    return path


def _float16_cnn(ws: Workspace, rel: str, opset: int | None = None) -> Path:
    """The corpus CNN with float16 weights, inputs and outputs (as a float16 conversion
    writes it), at its own opset or converted to ``opset``."""
    model = onnx.load(CORPUS / "cnn_torchscript.onnx")
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            half = numpy_helper.to_array(init).astype(np.float16)
            init.CopyFrom(numpy_helper.from_array(half, init.name))
    graph = model.graph
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    if opset is not None:
        model = onnx.version_converter.convert_version(model, opset)
    path = ws.root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def _samples(ws: Workspace, folder: str, dtype: type, count: int = 3) -> None:
    """``count`` random ``.npy`` samples of the CNN's input ``[1, 3, 32, 32]``."""
    (ws.root / folder).mkdir(parents=True)
    for i in range(count):
        sample = np.random.default_rng(i).standard_normal((1, 3, 32, 32)).astype(dtype)
        np.save(ws.root / folder / f"s{i}.npy", sample)


def _quantized(ws: Workspace) -> Path:
    """A manifest quantizing ``models/cnn.onnx`` (8-bit) on the samples in ``calib``."""
    _group(ws, "models/cnn.onnx", quantize="q")
    path = ws.root / "epbuild.toml"
    with path.open("a") as f:
        f.write('\n[quantization.q]\ncalibration = "calib/*.npy"\n')
    return path


def _group(ws: Workspace, *models: str, **group: object) -> None:
    groups = {"g": {"models": list(models), "providers": ["htp"], **group}}
    ws.manifest({"providers": {"htp": HTP73}, "groups": groups})


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_external_data_that_is_no_regular_file_is_named_as_such(
    workspace: Workspace, kind: str
) -> None:
    # both passed for a missing file; a folder whose references are parsed afresh, for one
    # truncated to its size (4096 bytes)
    _external_cnn(workspace, "models/cnn.onnx", "cnn.data")
    _group(workspace, "models/cnn.onnx")
    workspace.main("build", check=True)
    data = workspace.root / "models" / "cnn.data"
    data.unlink()
    if kind == "folder":
        data.mkdir()
    else:
        os.mkfifo(data)
    what = "a folder" if kind == "folder" else "a FIFO (named pipe)"
    for command in ("status", "build"):
        proc = workspace.main(command)
        out = proc.stdout + proc.stderr
        assert "external data file 'models/cnn.data'" in out, out
        assert f"is {what}, not a regular file" in out, out
        assert "truncated" not in out and "missing" not in out, out
        assert "Traceback" not in out
    shutil.rmtree(workspace.root / ".epbuild")  # a fresh stat cache: the references parsed now
    proc = workspace.main("build")
    assert proc.returncode == 1 and f"is {what}, not a regular file" in proc.stderr, proc.stderr


def test_verify_load_names_a_source_that_no_longer_loads(workspace: Workspace) -> None:
    # external data in a subfolder builds, verifies and loads; moved away after the build,
    # the ctx model is whole (verify) but its source does not load (ORT's message said
    # "FAIL: External data path validation failed" as if of the ctx model)
    _external_cnn(workspace, "models/cnn.onnx", "w/cnn.data")
    _group(workspace, "models/cnn.onnx")
    workspace.main("build", check=True)
    assert workspace.cli("verify", "--load").returncode == 0
    (workspace.root / "models" / "w").rename(workspace.root / "models" / "w2")
    assert "external data file 'models/w/cnn.data'" in workspace.main("status").stdout
    proc = workspace.cli("verify", "--load")
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "its source model models/cnn.onnx does not load on the CPU EP" in out, out
    assert "'epbuild status' says what changed" in out
    assert "Traceback" not in out


@pytest.mark.slow  # the transformers optimizer, a split compile and a load (a few seconds)
def test_contrib_ops_an_optimizer_wrote_are_not_sent_to_another_level(workspace: Workspace) -> None:
    # ORT's transformers optimizer fuses the exported BERT into com.microsoft ops the QNN
    # EP does not take; the split warning said 'try graph_optimization_level = "auto"',
    # which compiles four times and leaves the same split
    from onnxruntime.transformers.optimizer import optimize_model

    bert = optimize_model(str(CORPUS / "bert_torchscript.onnx"), model_type="bert",
                          num_heads=2, hidden_size=32, opt_level=0)  # fmt: skip
    (workspace.root / "models").mkdir(parents=True)
    bert.save_model_to_file(str(workspace.root / "models" / "bert.onnx"))
    _group(workspace, "models/bert.onnx", free_dimensions={"batch": 1, "sequence_length": 8})
    (action,) = workspace.build().actions
    (warning,) = action.warnings
    assert "on the CPU EP: com.microsoft::Attention x2" in warning, warning
    assert "those com.microsoft ops are in the model itself" in warning, warning
    assert '"auto"' not in warning
    assert workspace.main("status").stdout.startswith("up to date")
    proc = workspace.cli("verify", "--load")
    assert proc.returncode == 0 and "1 loaded and matched the CPU EP" in proc.stdout, proc.stdout


def test_a_float16_model_the_quantizer_would_make_invalid_is_refused(workspace: Workspace) -> None:
    # 8-bit types keep the graph's opset (17) and ORT's quantizer gave the QDQ model
    # float16 scales, which DequantizeLinear takes from opset 19: the compile failed with
    # ONNX Runtime's type error about build/.../quantized/cnn.onnx (exit 1)
    _float16_cnn(workspace, "models/cnn.onnx")
    _samples(workspace, "calib", np.float16)
    manifest = _quantized(workspace)
    before = manifest.read_bytes()
    proc = workspace.main("build")
    assert proc.returncode == 2, proc.stderr
    assert "models/cnn.onnx (quantization.q): a float16 model at opset 17" in proc.stderr
    assert "convert_version(model, 21)" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((workspace.root / "build").rglob("*.onnx"))
    assert manifest.read_bytes() == before
    assert "g/htp/cnn" in workspace.main("status").stdout


@pytest.mark.slow  # calibrate, quantize, compile and verify --numerics (a loader process)
def test_a_float16_model_at_opset_21_quantizes_and_checks(workspace: Workspace) -> None:
    # the refusal's own advice works; verify --numerics failed on it ("Type (tensor(float))
    # of output arg ... does not match expected type (tensor(float16))"): its per-layer
    # check typed every DequantizeLinear output float
    _float16_cnn(workspace, "models/cnn.onnx", opset=21)
    _samples(workspace, "calib", np.float16)
    _quantized(workspace)
    workspace.main("build", check=True)
    proc = workspace.cli("verify", "--load", "--numerics")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "numerics: ok" in proc.stdout, proc.stdout


def test_the_free_dimensions_hint_is_valid_toml_for_any_dimension_name(
    workspace: Workspace,
) -> None:
    # an exporter's dimension named 'batch size': the hint said free_dimensions =
    # { batch size = ... }, which is no TOML; pasted as given (quoted), it builds
    model = onnx.load(CORPUS / "cnn_torchscript.onnx")
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch size"
    (workspace.root / "models").mkdir(parents=True)
    onnx.save(model, workspace.root / "models" / "cnn.onnx")
    _group(workspace, "models/cnn.onnx")
    proc = workspace.main("build")
    assert proc.returncode == 1 and "symbolic dimension 'batch size'" in proc.stderr
    assert 'set groups.g.free_dimensions."batch size": ' in proc.stderr, proc.stderr
    table = proc.stderr.split("free_dimensions = ", 1)[1].split(" in [groups.g]")[0]
    assert table == '{ "batch size" = ... }', table
    with (workspace.root / "epbuild.toml").open("a") as f:
        f.write("free_dimensions = " + table.replace("...", "1") + "\n")
    workspace.main("build", check=True)
    assert workspace.main("status").stdout.startswith("up to date  g/htp/cnn")


def test_external_data_located_in_the_model_file_itself_is_refused(workspace: Workspace) -> None:
    # ONNX Runtime read the protobuf's own bytes as the weights: a build "succeeded"
    path = _external_cnn(workspace, "models/cnn.onnx", "cnn.data")
    model = onnx.load(path, load_external_data=False)
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = "cnn.onnx"
    onnx.save(model, path)
    _group(workspace, "models/cnn.onnx")
    for command in ("status", "build"):
        proc = workspace.main(command)
        out = proc.stdout + proc.stderr
        assert "has its external data 'location' in the model file itself" in out, out
        assert "Traceback" not in out
    assert not (workspace.root / "build" / "g").exists()
