"""The calibration's sessions and statistics (epbuild/llm/sessions.py, epbuild/llm/ranges.py)
on a small graph pair that reads one external-data file, as a part's context and iterator
graphs do: each weight mapped once and shared, the same outputs as a plain session, a
data file with two hard links (a restored cache entry) read, and the ranges ONNX Runtime's
own calibrators write, byte for byte."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from epbuild.llm.ranges import Ranges, augment, calibrated_tensors
from epbuild.llm.sessions import SharedWeights, load_weights, structure

DATA = "part.onnx.data"


def _graph(sequence: int) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    up = numpy_helper.from_array(rng.standard_normal((8, 64)).astype(np.float32), "up")
    down = numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32), "down")
    nodes = [
        helper.make_node("MatMul", ["x", "up"], ["h"], name="up_proj"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "down"], ["d"], name="down_proj"),
        helper.make_node("Add", ["d", "x"], ["y"], name="residual"),
    ]
    graph = helper.make_graph(
        nodes,
        "part",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, sequence, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, sequence, 8])],
        [up, down],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


@pytest.fixture
def part(tmp_path: Path) -> dict[str, Path]:
    """``context`` (4 tokens) and ``iterator`` (1) graphs reading one data file, which has
    a second hard link, as a cache restores it."""
    paths = {"context": tmp_path / "context.onnx", "iterator": tmp_path / "iterator.onnx"}
    for (graph, path), sequence in zip(paths.items(), (4, 1), strict=True):
        model = _graph(sequence)
        onnx.external_data_helper.convert_model_to_external_data(
            model, all_tensors_to_one_file=True, location=DATA, size_threshold=0
        )
        if graph == "context":
            onnx.save(model, path)
        else:  # the same weights, at the same offsets: the context graph's data file
            done = structure(str(paths["context"]))
            model.graph.ClearField("initializer")
            model.graph.initializer.extend(done.graph.initializer)
            onnx.save(model, path)
    os.link(tmp_path / DATA, tmp_path / "restored.data")
    return paths


def _mapped(name: str) -> int:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return sum(1 for line in f if line.rstrip().endswith(name))


def test_shared_sessions_map_each_weight_once_and_match_a_plain_session(
    part: dict[str, Path],
) -> None:
    weights = SharedWeights()
    folder = str(part["context"].parent)
    sessions = {g: weights.session(structure(str(p)), folder) for g, p in part.items()}
    del weights  # each session keeps the mapped weights
    if sys.platform.startswith("linux"):
        assert _mapped(DATA) == 1
    rng = np.random.default_rng(5)
    for graph, sequence in (("context", 4), ("iterator", 1)):
        x = rng.standard_normal((1, sequence, 8)).astype(np.float32)
        plain = ort.InferenceSession(str(part[graph]), providers=["CPUExecutionProvider"])
        want = plain.run(None, {"x": x})[0]
        np.testing.assert_allclose(
            sessions[graph].run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5
        )


def test_weights_read_from_a_hard_linked_data_file(part: dict[str, Path]) -> None:
    with pytest.raises(Exception, match="hard link"):  # onnx's own loader refuses it
        onnx.load(part["context"])
    model = load_weights(structure(str(part["context"])), str(part["context"].parent))
    got = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in _graph(4).graph.initializer}
    assert got.keys() == want.keys()
    for name, values in want.items():
        np.testing.assert_array_equal(got[name], values)


@pytest.mark.parametrize("method", ["MinMax", "Entropy"])
def test_ranges_are_those_onnxruntimes_calibrator_writes(tmp_path: Path, method: str) -> None:
    from onnxruntime.quantization import CalibrationMethod, save_tensors_data
    from onnxruntime.quantization.calibrate import create_calibrator

    from epbuild.quant.work import _canonical

    model = _graph(4)
    path = tmp_path / "float.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(11)
    feeds = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32)} for _ in range(5)]
    calibration = getattr(CalibrationMethod, method)
    ops = {n.op_type for n in model.graph.node}

    class Reader:
        def __init__(self) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    theirs = create_calibrator(
        str(path),
        sorted(ops),
        augmented_model_path=str(tmp_path / "augmented.onnx"),
        calibrate_method=calibration,
    )
    theirs.collect_data(Reader())
    save_tensors_data(theirs.compute_data(), str(tmp_path / "theirs.json"))

    tensors = calibrated_tensors(model, ops)
    augmented = augment(structure(str(path)), tensors, method == "MinMax")
    session = SharedWeights().session(augmented, str(tmp_path), optimize=False)
    names = [o.name for o in session.get_outputs()]
    mine = Ranges(tensors, calibration, chunk=len(feeds))
    for feed in feeds:
        mine.add(dict(zip(names, session.run(None, feed), strict=True)))
    save_tensors_data(mine.data(), str(tmp_path / "mine.json"))
    for name in ("theirs.json", "mine.json"):
        _canonical(str(tmp_path / name))
    assert sorted(json.loads((tmp_path / "mine.json").read_text())["data"]) == sorted(tensors)
    assert (tmp_path / "mine.json").read_bytes() == (tmp_path / "theirs.json").read_bytes()
