"""The ranges of one static LLM graph's tensors, gathered as ONNX Runtime's calibrators
gather them, from a session that is also the graph's runner: the graph is augmented with
what the method needs of each tensor (``minmax``: a ``ReduceMin`` and a ``ReduceMax``;
the histogram methods: the tensor itself) as extra outputs, so that one run gives the
graph's own outputs (the KV cache the next run is fed, what the next part reads) and the
statistics at once, and no second session of the same weights is needed.

The tensors are those ONNX Runtime's calibrators choose (inputs and outputs of every node
of the op types calibrated, of a float type, not weights) and the statistics theirs
(``minmax``: the least minimum and the greatest maximum over the runs; the others:
``HistogramCollector`` with ``create_calibrator``'s settings, fed a chunk of runs at a
time), so that the ranges file (``save_tensors_data``) is the one their calibrator writes.

Imports numpy, onnx and onnxruntime: call it from a worker.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
_RESHAPE = "epbuild_calibration_flat"
"""The ``[-1]`` shape each reduction is reshaped by (as ONNX Runtime's calibrator does)."""
HISTOGRAMS: Mapping[str, tuple[str, bool, int, int, float, str]] = {
    "Entropy": ("entropy", False, 128, 128, 99.999, "same"),
    "Percentile": ("percentile", True, 2048, 2048, 99.999, "same"),
    "Distribution": ("distribution", False, 2048, 2048, 99.999, "same"),
}
"""``HistogramCollector``'s settings (method, symmetric, bins, quantized bins, percentile,
scenario) for each ``CalibrationMethod`` as ``create_calibrator`` makes its calibrator."""


def calibrated_tensors(model: onnx.ModelProto, ops: Collection[str]) -> list[str]:
    """The tensors ONNX Runtime's calibrators calibrate in ``model`` (its shapes inferred):
    each input and output of a node of an op type in ``ops`` that is typed float, not a
    weight; in the order they are first met."""
    graph = model.graph
    values = {v.name: v for v in (*graph.value_info, *graph.output, *graph.input)}
    weights = {t.name for t in graph.initializer}
    found: dict[str, None] = {}
    for node in graph.node:
        if node.op_type not in ops:
            continue
        for name in itertools.chain(node.input, node.output):
            value = values.get(name)
            if value is None or name in weights or not value.type.HasField("tensor_type"):
                continue
            if value.type.tensor_type.elem_type in _FLOATS:
                found[name] = None
    return list(found)


def augment(model: onnx.ModelProto, tensors: Sequence[str], minmax: bool) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with each of ``tensors`` as an output:
    ``minmax``: its ``ReduceMin`` and ``ReduceMax`` (``<name>_ReduceMin``, ``..Max``),
    else the tensor itself (one already an output stays one)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    values = {v.name: v for v in (*graph.value_info, *graph.output, *graph.input)}
    if not minmax:
        graph.output.extend(values[t] for t in tensors if t not in outputs)
        return model
    graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), _RESHAPE))
    for name in tensors:
        kind = values[name].type.tensor_type.elem_type
        for op in ("ReduceMin", "ReduceMax"):
            out = f"{name}_{op}"
            graph.node.append(
                helper.make_node(op, [name], [out + "_Reshape"], keepdims=1, name=out)
            )
            graph.node.append(
                helper.make_node("Reshape", [out + "_Reshape", _RESHAPE], [out], name=out + "_R")
            )
            graph.output.append(helper.make_tensor_value_info(out, kind, [None]))
    return model


class Ranges:
    """The statistics of one graph's tensors over its runs (``add`` each run's outputs,
    by name), and the ranges they make (``data``)."""

    def __init__(self, tensors: Sequence[str], method: Any, chunk: int) -> None:
        self.tensors = list(tensors)
        self.method = method
        self.minmax = method.name == "MinMax"
        self.chunk = chunk
        self._low: dict[str, np.ndarray] = {}
        self._high: dict[str, np.ndarray] = {}
        self._pending: list[Mapping[str, np.ndarray]] = []
        self._collector: Any = None

    def add(self, outputs: Mapping[str, np.ndarray]) -> None:
        """Take one run's outputs (the augmented graph's, by name)."""
        if not self.minmax:
            self._pending.append({t: outputs[t] for t in self.tensors})
            if len(self._pending) >= self.chunk:
                self._collect()
            return
        for name in self.tensors:
            low, high = outputs[f"{name}_ReduceMin"], outputs[f"{name}_ReduceMax"]
            if name in self._low:
                low, high = np.fmin(self._low[name], low), np.fmax(self._high[name], high)
            self._low[name], self._high[name] = low, high

    def _collect(self) -> None:
        from onnxruntime.quantization.calibrate import HistogramCollector

        if not self._pending:
            return
        if self._collector is None:
            self._collector = HistogramCollector(*HISTOGRAMS[self.method.name])
        self._collector.collect({t: [run[t] for run in self._pending] for t in self.tensors})
        self._pending = []

    def data(self) -> Any:
        """The ranges (ONNX Runtime's ``TensorsData``) of the runs taken."""
        from onnxruntime.quantization.calibrate import TensorsData

        if self.minmax:
            pairs = {t: (self._low[t], self._high[t]) for t in self.tensors if t in self._low}
            return TensorsData(self.method, pairs)
        self._collect()
        return TensorsData(self.method, self._collector.compute_collection_result())
