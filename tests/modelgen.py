"""Tiny ONNX models for tests (generated, never committed)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], x: list[int | str],
           y: list[int | str], name: str = "g") -> onnx.ModelProto:  # fmt: skip
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def matmul_model(seed: int = 0, n: int = 32, batch: int | str = 1,
                 shared: np.ndarray | None = None) -> onnx.ModelProto:  # fmt: skip
    """x[batch,n] @ W → Relu → @ V. ``shared`` fixes W (for weight-sharing groups); a
    string ``batch`` is a symbolic dimension of that name."""
    rng = np.random.default_rng(seed)
    w = shared if shared is not None else rng.standard_normal((n, n), dtype=np.float32) * 0.1
    v = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "V"], ["y"]),
    ]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")]
    return _model(nodes, inits, [batch, n], [batch, n])


def partial_model(seed: int = 0, n: int = 32, op: str = "Acos") -> onnx.ModelProto:
    """supported → unsupported (Acos) → supported: two EPContext nodes + CPU nodes."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, n), dtype=np.float32) * 0.01
    v = rng.standard_normal((n, n), dtype=np.float32) * 0.1
    c = rng.standard_normal((n,), dtype=np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node(op, ["t"], ["a"]),
        helper.make_node("Add", ["a", "C"], ["b"]),
        helper.make_node("MatMul", ["b", "V"], ["y"]),
    ]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V"),
             numpy_helper.from_array(c, "C")]  # fmt: skip
    return _model(nodes, inits, [1, n], [1, n])


def rank5_layer_norm_model(n: int = 32) -> onnx.ModelProto:
    """A hand-written LayerNorm (ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add)
    over a rank-5 input. ORT's basic-level LayerNormFusion makes it one LayerNormalization,
    which the QNN EP refuses on HTP at rank 5: at ``all`` and ``basic`` the EP compiles
    nothing; at ``disabled`` it takes all but the Sqrt (2 EPContext nodes)."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]),
        helper.make_node("Sub", ["x", "mu"], ["c"]),
        helper.make_node("Pow", ["c", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["c", "sd"], ["nrm"]),
        helper.make_node("Mul", ["nrm", "gamma"], ["g"]),
        helper.make_node("Add", ["g", "beta"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(2, f32), "two"),
             numpy_helper.from_array(np.array(1e-5, f32), "eps"),
             numpy_helper.from_array(1 + 0.1 * rng.standard_normal(n).astype(f32), "gamma"),
             numpy_helper.from_array(0.1 * rng.standard_normal(n).astype(f32), "beta")]  # fmt: skip
    shape: list[int | str] = [1, 2, 2, 4, n]
    return _model(nodes, inits, shape, shape)


def unsupported_model() -> onnx.ModelProto:
    """Only ops the QNN EP cannot take: nothing gets compiled."""
    nodes = [helper.make_node("Acos", ["x"], ["y"])]
    return _model(nodes, [], [1, 8], [1, 8])


def save(
    model: onnx.ModelProto, path: str | os.PathLike[str], *, external: str | None = None
) -> Path:
    """Save a model, optionally with all tensors in one external-data file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=external, size_threshold=0)  # fmt: skip
    else:
        onnx.save(model, path)
    return path
