"""Weight quantization without ONNX Runtime's Python loops and whole-weight temporaries.

ONNX Runtime's QDQ quantizer computes a per-channel weight's scales and zero points, and
then its quantized values, one channel at a time in Python
(``QDQQuantizer._calc_initializer_quant_params``, ``quant_utils.quantize_onnx_initializer``):
for an LLM's ``lm_head`` of 151,936 output channels that is two loops of 151,936 numpy calls,
~8 s of a part's quantization. A per-tensor weight is quantized through four temporaries of
its own size (545 MB each for that ``lm_head``). :func:`vectorized` runs the same arithmetic
on every channel at once and in place, a few MB at a time (the same dtypes, the same
operations in the same order, so the same bits: the tests compare both on every integer
type), and hands every case it does not cover (per-block, float 8, per-channel, range or
scale overrides, an empty or non-finite weight) to ONNX Runtime's own code unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import qdq_quantizer, quant_utils

_INTEGER = frozenset(
    {
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.INT4,
        onnx.TensorProto.UINT4,
    }
)
_PLAIN_KEYS = frozenset({"quant_type", "axis", "symmetric", "reduce_range"})
"""Per-tensor override keys the vectorized parameters honour; any other goes to ORT."""
_MARK = "_epbuild_vectorized"
"""Set on the parameters method while :func:`vectorized` is in force."""
_PIECE = 1 << 20
"""Elements quantized at once (a 4 MB float piece, reused: no whole-weight temporaries)."""


def scale_zero_point(
    data: np.ndarray,
    axis: int | None,
    quant_type: int,
    symmetric: bool,
    reduce_range: bool,
    min_real_range: float | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The zero point and scale ORT's ``compute_data_quant_params`` gives ``data`` (``axis``
    None), or each of its channels along ``axis`` (stacked as ``QDQQuantizer`` stacks them);
    None where only ORT's own code gives them (an empty or non-finite weight)."""
    if data.size == 0:
        return None
    if axis is None:
        rmin = np.array(data.min(), dtype=data.dtype)
        rmax = np.array(data.max(), dtype=data.dtype)
    else:
        others = tuple(i for i in range(data.ndim) if i != axis)
        rmin, rmax = data.min(axis=others), data.max(axis=others)
    qmin, qmax = quant_utils.get_qmin_qmax_for_qType(quant_type, reduce_range, symmetric=symmetric)
    # compute_scale_zp, one array of channels for its scalars
    rmin = np.minimum(rmin, np.array(0, dtype=rmin.dtype))
    rmax = np.maximum(rmax, np.array(0, dtype=rmax.dtype))
    if min_real_range is not None:
        floor = rmin + np.asarray(min_real_range, dtype=rmin.dtype)
        rmax = np.where(floor > rmax, floor, rmax)
    if symmetric:
        absmax = np.maximum(np.abs(rmin), np.abs(rmax))
        rmin, rmax = -absmax, +absmax
    dr = np.asarray(rmax, dtype=np.float64) - np.asarray(rmin, dtype=np.float64)
    dq = np.array(qmax, dtype=np.float64) - np.array(qmin, dtype=np.float64)
    scale = dr / dq
    if not bool(np.all(scale >= 0)):  # NaN: ORT's assertion, raised by ORT
        return None
    finfo = np.finfo(rmax.dtype)
    half = rmax.dtype == np.float16
    min_scale = finfo.smallest_subnormal if half else finfo.tiny
    stored = scale.astype(rmax.dtype)
    degenerate = (stored if half else scale) < min_scale
    if symmetric:
        middle = np.round((qmin + qmax) / np.array(2.0, dtype=np.float64))
        zero = np.broadcast_to(middle, scale.shape)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            zero = np.round(qmin - rmin / np.where(degenerate, 1.0, scale))
    zero_point = np.where(degenerate, 0, zero).astype(qmin.dtype)
    return zero_point, np.where(degenerate, np.array(1.0, dtype=rmax.dtype), stored)


def quantize(
    data: np.ndarray, quant_type: int, zero_point: np.ndarray, scale: np.ndarray, axis: int | None
) -> np.ndarray:
    """``data`` quantized as ORT's ``quantize_nparray`` quantizes it (``axis`` None) or each
    of its channels along ``axis``, :data:`_PIECE` elements at a time."""
    dtype = quant_utils.ONNX_TYPE_TO_NP_TYPE[quant_type]
    qmin, qmax = quant_utils.get_qmin_qmax_for_qType(
        quant_type, reduce_range=False, symmetric=False
    )
    if axis is None:  # one scale: the weight's elements in a row
        data = data.reshape(-1)
    else:
        shape = [1] * data.ndim
        shape[axis] = data.shape[axis]
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
    out = np.empty(data.shape, dtype=dtype)
    lead = max(1, _PIECE // max(1, data.size // max(1, data.shape[0])))
    for start in range(0, data.shape[0], lead):
        rows = slice(start, start + lead)
        s = scale[rows] if axis == 0 else scale
        z = zero_point[rows] if axis == 0 else zero_point
        piece = data[rows].astype(np.float32)
        np.divide(piece, s, out=piece)
        np.round(piece, out=piece)
        if np.result_type(piece, z) == np.float32:
            np.add(piece, z, out=piece)
        else:  # a wider sum, as ORT's: clipped before it narrows
            piece = piece + z
        np.clip(piece, qmin, qmax, out=piece)
        out[rows] = piece.astype(dtype)
    return out


def pack_4bit(src: bytes) -> bytes:
    """Two 8-bit values (4-bit ones, each in the low half of its byte) a byte, the first in
    the low half: ORT's ``pack_bytes_to_4bit`` (a Python loop over every pair, ~10 s for an
    ``lm_head``) at once."""
    values = np.frombuffer(src, dtype=np.uint8) & 0xF
    if values.size % 2:
        values = np.append(values, np.uint8(0))
    return ((values[1::2] << 4) | values[0::2]).astype(np.uint8).tobytes()


def _tensor(
    weight: onnx.TensorProto, quant_type: int, values: np.ndarray, name: str | None
) -> onnx.TensorProto:
    """The quantized initializer, made as ``quantize_onnx_initializer`` makes it."""
    q_name = name if name else f"{weight.name}{quant_utils.TENSOR_NAME_QUANT_SUFFIX}"
    if quant_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        packed = pack_4bit(values.tobytes())
        return onnx.helper.make_tensor(q_name, quant_type, weight.dims, packed, raw=True)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(quant_type)
    array = np.asarray(values, dtype=np_type).reshape(weight.dims)
    return onnx.numpy_helper.from_array(array, q_name)


def _initializer(original: Callable[..., onnx.TensorProto]) -> Callable[..., onnx.TensorProto]:
    def quantize_onnx_initializer(
        weight: onnx.TensorProto,
        quant_type: int,
        zero_point: np.ndarray,
        scale: np.ndarray,
        axis: int | None = None,
        quant_weight_name: str | None = None,
        block_size: int = 0,
    ) -> onnx.TensorProto:
        if block_size > 0 or quant_type not in _INTEGER:
            return original(
                weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size
            )
        data = quant_utils.tensor_proto_to_array(weight)
        values = quantize(data, quant_type, np.asarray(zero_point), np.asarray(scale), axis)
        return _tensor(weight, quant_type, values, quant_weight_name)

    return quantize_onnx_initializer


def _plain(
    quantizer: Any, name: str, info: Any
) -> tuple[np.ndarray, int | None, bool, bool, int] | None:
    """What ``_calc_initializer_quant_params`` reads for ``name`` (the weight, its axis or
    None, symmetry, reduced range and type) where it computes the parameters from the weight
    alone (no per-channel, range or scale overrides, not per block); None where ORT's own
    code must decide."""
    overrides = quantizer.tensor_quant_overrides
    if overrides.overrides_scale_zp(name):
        return None
    mine = overrides.get(name, [{}])
    if len(mine) != 1 or not set(mine[0]) <= _PLAIN_KEYS:
        return None
    is_weight = info.tensor_type is qdq_quantizer.QDQQuantTensorType.WEIGHT
    if is_weight and getattr(quantizer, "block_size", 0) > 0:
        return None
    quant_type = quantizer.weight_qType if is_weight else quantizer.activation_qType
    if "quant_type" in mine[0]:
        quant_type = mine[0]["quant_type"].tensor_type
    axis = mine[0].get("axis", info.axis)
    if quant_type not in _INTEGER:
        return None
    initializer = quant_utils.find_by_name(name, quantizer.model.initializer())
    if not initializer:
        return None
    data = quant_utils.tensor_proto_to_array(initializer)
    if axis is None:
        default = (
            quantizer.is_weight_symmetric(quant_type)
            if is_weight
            else quantizer.is_activation_symmetric
        )
    else:
        valid, axis = quant_utils.normalize_axis(axis, data.ndim)
        if not valid:
            return None
        default = True  # per channel: always symmetric unless overridden
    symmetric = bool(mine[0].get("symmetric", default))
    reduce_range = bool(mine[0].get("reduce_range", quantizer.reduce_range))
    return data, axis, symmetric, reduce_range, quant_type


def _parameters(original: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    def _calc_initializer_quant_params(self: Any) -> dict[str, Any]:
        order = list(self.tensors_to_quantize)
        done: dict[str, Any] = {}
        for name, info in self.tensors_to_quantize.items():
            plain = _plain(self, name, info)
            if plain is None:
                continue
            data, axis, symmetric, reduce_range, quant_type = plain
            found = scale_zero_point(
                data, axis, quant_type, symmetric, reduce_range, self.min_real_range
            )
            if found is not None:
                done[name] = qdq_quantizer.QuantizationParams(
                    zero_point=found[0], scale=found[1], quant_type=quant_type, axis=axis
                )
        everything = self.tensors_to_quantize
        self.tensors_to_quantize = {k: v for k, v in everything.items() if k not in done}
        try:
            rest = original(self)
        finally:
            self.tensors_to_quantize = everything
        merged = {**rest, **done}
        return {name: merged[name] for name in order if name in merged}

    return _calc_initializer_quant_params


@contextmanager
def vectorized() -> Iterator[None]:
    """Inside, ONNX Runtime's QDQ quantizer quantizes weights vectorized, in pieces. Entered
    while already in force (another thread's quantization), it changes nothing: the first
    to enter puts ORT's own code back (the same bits either way)."""
    cls = qdq_quantizer.QDQQuantizer
    params = cls.__dict__.get("_calc_initializer_quant_params")
    initializer = getattr(qdq_quantizer, "quantize_onnx_initializer", None)
    if params is None or initializer is None or hasattr(params, _MARK):
        yield  # another ORT (its own code, unchanged), or already in force
        return
    fast_params, fast_initializer = _parameters(params), _initializer(initializer)
    setattr(fast_params, _MARK, True)
    cls._calc_initializer_quant_params = fast_params
    qdq_quantizer.quantize_onnx_initializer = fast_initializer
    try:
        yield
    finally:
        cls._calc_initializer_quant_params = params
        qdq_quantizer.quantize_onnx_initializer = initializer
