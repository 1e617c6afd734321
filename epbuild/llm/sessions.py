"""CPU sessions of prepared LLM graphs that hold each weight once: a part's ``context`` and
``iterator`` graphs read one external-data file, and ONNX Runtime would load (or map) it
once per session and pre-pack every MatMul weight into a copy of its own; here each data
file is mapped once (read-only, so the weights are the page cache's, never the process's
own copy), each weight handed to every session that reads it as the same buffer
(``SessionOptions.add_initializer``), and pre-packing is off. Measured on a 0.5B-shaped
part: two plain sessions 1.0 GB resident, these two 0.55 GB, the same outputs.

The graphs are read without their weights (``onnx.load(..., load_external_data=False)``):
onnx's own loader refuses a data file with several hard links, which a restored cache
entry is. Imports numpy, onnx and onnxruntime: call it from a worker.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto
from onnx.helper import tensor_dtype_to_np_dtype

_FOLDER = "session.model_external_initializers_file_folder_path"
"""Where ONNX Runtime looks for the external data of a graph given as bytes."""


class SharedWeights:
    """The mapped data files of graphs and the weights made of them, shared by the
    sessions ``session`` makes (each session keeps it: the weights are unmapped when the
    last one goes)."""

    def __init__(self) -> None:
        self._maps: dict[str, np.memmap[Any, Any]] = {}
        self._values: dict[tuple[str, str], Any] = {}

    def _weight(self, tensor: onnx.TensorProto, folder: str) -> Any:
        """The ``OrtValue`` of an external ``tensor`` (data in ``folder``), made once."""
        import onnxruntime as ort

        ref = {e.key: e.value for e in tensor.external_data}
        path = os.path.realpath(os.path.join(folder, ref["location"]))
        key = (path, tensor.name)
        if key not in self._values:
            if path not in self._maps:
                self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
            offset = int(ref.get("offset", 0))
            dtype = np.dtype(tensor_dtype_to_np_dtype(tensor.data_type))
            length = int(ref.get("length", 0)) or int(np.prod(tensor.dims)) * dtype.itemsize
            values = self._maps[path][offset : offset + length].view(dtype)
            self._values[key] = ort.OrtValue.ortvalue_from_numpy(values.reshape(tuple(tensor.dims)))
        return self._values[key]

    def session(self, model: onnx.ModelProto, folder: str, *, optimize: bool = True) -> Any:
        """A CPU session of ``model`` (read without its weights; its external data in
        ``folder``), its external weights this object's. ``optimize`` False: no graph
        optimization (as ONNX Runtime's calibrators run their augmented graphs)."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_session_config_entry("session.disable_prepacking", "1")
        options.add_session_config_entry(_FOLDER, folder)
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        for tensor in model.graph.initializer:
            if tensor.data_location == TensorProto.EXTERNAL:
                options.add_initializer(tensor.name, self._weight(tensor, folder))
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        session.epbuild_weights = self  # the mapped weights live as long as a session reads them
        return session


def structure(path: str) -> onnx.ModelProto:
    """The graph at ``path`` without its external weights."""
    return onnx.load(os.fspath(path), load_external_data=False)


def load_weights(model: onnx.ModelProto, folder: str) -> onnx.ModelProto:
    """``model`` (read by ``structure``; changed in place and returned) with its external
    weights read from their files in ``folder`` into it, as onnx's loader would but
    without refusing a data file that has several hard links."""
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        ref = {e.key: e.value for e in tensor.external_data}
        with open(os.path.join(folder, ref["location"]), "rb") as f:
            f.seek(int(ref.get("offset", 0)))
            length = ref.get("length")
            tensor.raw_data = f.read(int(length)) if length else f.read()
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT
    return model
