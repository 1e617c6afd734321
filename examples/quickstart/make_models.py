"""Regenerate the quickstart's tiny models (committed; run only to change them).

prefill.onnx and decode.onnx share the weight W (a weight-sharing group, as an LLM's prefill
and decode graphs do); classifier.onnx is independent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).parent / "models"


def mlp(name: str, batch: int, shared: np.ndarray, own: np.ndarray) -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "V"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, shared.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, own.shape[1]])],
        [numpy_helper.from_array(shared, "W"), numpy_helper.from_array(own, "V")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def main() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64), dtype=np.float32) * 0.1
    HERE.mkdir(exist_ok=True)
    v1 = rng.standard_normal((64, 32), dtype=np.float32) * 0.1
    v2 = rng.standard_normal((64, 32), dtype=np.float32) * 0.1
    onnx.save(mlp("prefill", 8, w, v1), HERE / "prefill.onnx")
    onnx.save(mlp("decode", 1, w, v2), HERE / "decode.onnx")
    c1 = rng.standard_normal((32, 32), dtype=np.float32) * 0.1
    c2 = rng.standard_normal((32, 10), dtype=np.float32) * 0.1
    onnx.save(mlp("classifier", 1, c1, c2), HERE / "classifier.onnx")


if __name__ == "__main__":
    main()
