"""Weight quantization without ORT's loops gives ONNX Runtime's own bits."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    qdq_quantizer,
    quant_utils,
    quantize_static,
)

from epbuild.quant import weights

TYPES = [
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.INT16,
    TensorProto.UINT16,
    TensorProto.INT4,
    TensorProto.UINT4,
]


def _weight(shape: tuple[int, ...], axis: int, dtype: type, seed: int) -> np.ndarray:
    """Random channels, and the awkward ones: all zeros, one constant, all negative, all
    positive, subnormal."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape).astype(np.float32) * 3
    moved = np.moveaxis(data, axis, 0)
    moved[0] = 0.0
    moved[1] = 0.25
    moved[2] = -np.abs(moved[2])
    moved[3] = np.abs(moved[3])
    moved[4] = 1e-41 if dtype is np.float32 else 1e-7
    return data.astype(dtype)


def _ort_params(data, axis, quant_type, symmetric, reduce_range, min_real_range):
    if axis is None:  # as QDQQuantizer asks for a per-tensor weight
        return quant_utils.compute_data_quant_params(
            data.flatten(),
            quant_type,
            symmetric,
            reduce_range=reduce_range,
            min_real_range=min_real_range,
        )
    zero_points, scales = [], []
    for i in range(data.shape[axis]):
        zp, scale = quant_utils.compute_data_quant_params(
            data.take(i, axis).ravel(),
            quant_type,
            symmetric,
            reduce_range=reduce_range,
            min_real_range=min_real_range,
        )
        zero_points.append(zp)
        scales.append(scale)
    return np.asarray(zero_points), np.asarray(scales)


CASES = list(
    itertools.product(
        TYPES,
        [True, False],  # symmetric
        [False, True],  # reduce range
        [((6, 9), 0), ((7, 12), 1), ((5, 3, 8), 2), ((6, 9), None)],
        [np.float32, np.float16],
    )
)


@pytest.mark.parametrize(("quant_type", "symmetric", "reduce", "layout", "dtype"), CASES)
def test_same_bits_as_onnx_runtime(quant_type, symmetric, reduce, layout, dtype) -> None:
    shape, axis = layout
    data = _weight(shape, axis or 0, dtype, seed=len(shape) + quant_type)
    for floor in (None, 0.5):
        want_zp, want_scale = _ort_params(data, axis, quant_type, symmetric, reduce, floor)
        found = weights.scale_zero_point(data, axis, quant_type, symmetric, reduce, floor)
        assert found is not None
        zp, scale = found
        assert (zp.dtype, scale.dtype) == (want_zp.dtype, want_scale.dtype)
        assert zp.tobytes() == want_zp.tobytes() and scale.tobytes() == want_scale.tobytes()

    weight = numpy_helper.from_array(data, "w")
    want = quant_utils.quantize_onnx_initializer(weight, quant_type, want_zp, want_scale, axis)
    mine = weights._initializer(quant_utils.quantize_onnx_initializer)
    got = mine(weight, quant_type, want_zp, want_scale, axis)
    assert got.SerializeToString() == want.SerializeToString()


@pytest.mark.parametrize("count", [0, 1, 2, 7, 1000])
def test_4bit_packing_is_onnx_runtimes(count) -> None:
    src = np.random.default_rng(count).integers(0, 256, count, dtype=np.uint8).tobytes()
    assert weights.pack_4bit(src) == bytes(quant_utils.pack_bytes_to_4bit(src))


def test_quantized_in_pieces(monkeypatch) -> None:
    """A weight larger than one piece is quantized piece by piece to the same bits, along
    either axis and per tensor."""
    monkeypatch.setattr(weights, "_PIECE", 7)
    for axis in (0, 1, None):
        data = _weight((9, 11), axis or 0, np.float32, seed=axis or 2)
        zp, scale = _ort_params(data, axis, TensorProto.INT8, True, False, None)
        weight = numpy_helper.from_array(data, "w")
        want = quant_utils.quantize_onnx_initializer(weight, TensorProto.INT8, zp, scale, axis)
        got = weights._initializer(quant_utils.quantize_onnx_initializer)(
            weight, TensorProto.INT8, zp, scale, axis
        )
        assert got.SerializeToString() == want.SerializeToString()


def test_what_it_cannot_vectorize_goes_to_onnx_runtime() -> None:
    """A weight with a NaN (ORT raises its own assertion) and an empty one are left to ORT."""
    nan = np.ones((4, 3), np.float32)
    nan[1, 1] = np.nan
    empty = np.zeros((0, 3), np.float32)
    for axis in (1, None):
        assert weights.scale_zero_point(nan, axis, TensorProto.INT8, True, False, None) is None
        assert weights.scale_zero_point(empty, axis, TensorProto.INT8, True, False, None) is None


class _Reader(CalibrationDataReader):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self._batches = iter(
            [{"x": rng.standard_normal((2, 16)).astype(np.float32)} for _ in range(4)]
        )

    def get_next(self):
        return next(self._batches, None)


def _model(path: str) -> None:
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 24)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((24, 8)).astype(np.float32), "w2")
    b = numpy_helper.from_array(rng.standard_normal((24,)).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
            helper.make_node("Relu", ["hb"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [w1, w2, b],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)


@pytest.mark.parametrize("weight_type", [QuantType.QInt8, QuantType.QInt4, QuantType.QUInt8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_a_whole_quantization_is_the_same_model(
    tmp_path, weight_type, per_channel, monkeypatch
) -> None:
    """``quantize_static`` inside :func:`vectorized` writes the model it writes outside, and
    the quantizer is ORT's own again afterwards; a per-tensor override of a weight's type (an
    lm_head kept at 8 bits) takes the vectorized path too."""
    source = str(tmp_path / "m.onnx")
    _model(source)
    overrides = {"w2": [{"quant_type": QuantType.QInt8, "axis": 1}]}

    def run(out: str) -> bytes:
        quantize_static(
            source,
            out,
            _Reader(),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt16,
            weight_type=weight_type,
            per_channel=per_channel,
            extra_options={"TensorQuantOverrides": overrides},
        )
        return onnx.load(out).SerializeToString()

    original = qdq_quantizer.QDQQuantizer._calc_initializer_quant_params
    want = run(str(tmp_path / "ort.onnx"))
    vectorized: list[tuple[int, ...]] = []
    params = weights.scale_zero_point

    def spy(data, *args):
        vectorized.append(data.shape)
        return params(data, *args)

    monkeypatch.setattr(weights, "scale_zero_point", spy)
    with weights.vectorized():
        assert qdq_quantizer.QDQQuantizer._calc_initializer_quant_params is not original
        with weights.vectorized():  # entered again (another thread): nothing changes
            got = run(str(tmp_path / "fast.onnx"))
        assert qdq_quantizer.QDQQuantizer._calc_initializer_quant_params is not original
    assert sorted(vectorized) == [(16, 24), (24,), (24, 8)]  # w1, w2 (per channel or not); b
    assert got == want
    assert qdq_quantizer.QDQQuantizer._calc_initializer_quant_params is original
    assert qdq_quantizer.quantize_onnx_initializer is quant_utils.quantize_onnx_initializer


CORPUS = Path(__file__).parent / "corpus"


class _RandomFeeds(CalibrationDataReader):
    """Four random feeds of a model's inputs (token ids below 64, floats around 0; each
    symbolic dimension 1, a sequence 8)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        rng = np.random.default_rng(3)
        feeds = []
        for _ in range(4):
            feed = {}
            for value in model.graph.input:
                tensor = value.type.tensor_type
                dims = [d.dim_value or (1 if i == 0 else 8) for i, d in enumerate(tensor.shape.dim)]
                dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
                if np.issubdtype(dtype, np.integer):
                    feed[value.name] = rng.integers(0, 64, dims).astype(dtype)
                else:
                    feed[value.name] = rng.standard_normal(dims).astype(dtype)
            feeds.append(feed)
        self._feeds = iter(feeds)

    def get_next(self):
        return next(self._feeds, None)


@pytest.mark.parametrize(
    "name", ["cnn_torchscript.onnx", "bert_torchscript.onnx", "llama_dynamo_external.onnx"]
)
def test_exported_models_quantize_to_the_same_bytes(tmp_path, name, monkeypatch) -> None:
    """Models from real exporters (a CNN's Conv weights per channel on axis 0, a BERT's and
    a Llama's MatMul weights, one with external data) quantize to the same model inside
    :func:`weights.vectorized` as with ONNX Runtime's own code, per channel and not."""
    source = CORPUS / name
    model = onnx.load(source)
    params = weights.scale_zero_point
    seen: list[int | None] = []
    monkeypatch.setattr(
        weights,
        "scale_zero_point",
        lambda data, axis, *a: seen.append(axis) or params(data, axis, *a),
    )
    for per_channel in (True, False):

        def run(out: Path, source=source, per_channel=per_channel) -> bytes:
            quantize_static(
                str(source),
                str(out),
                _RandomFeeds(model),
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QUInt16,
                weight_type=QuantType.QInt8,
                per_channel=per_channel,
            )
            return onnx.load(str(out)).SerializeToString()

        want = run(tmp_path / f"ort-{per_channel}.onnx")
        seen.clear()
        with weights.vectorized():
            got = run(tmp_path / f"fast-{per_channel}.onnx")
        assert got == want, (name, per_channel)
        assert seen, "no weight took the vectorized path"
        assert any(axis is not None for axis in seen) == per_channel
