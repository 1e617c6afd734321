"""The activations ``verify --numerics`` compares in one static LLM graph: its float graph
and its QDQ graph, each augmented with the activations as extra outputs (as
``epbuild.llm.ranges`` augments a calibration's), so that one session of a graph gives its
own outputs and its activations at once, its weights read in place (``llm.sessions``):
no copy of a graph is written, and no second session of the same weights is made (ONNX
Runtime's ``qdq_loss_debug`` writes both graphs out augmented, weights included).

The tensors are those ``qdq_loss_debug`` saves: in the float graph, every float input and
output of a node that is not a weight; in the QDQ graph, the tensors its matching
(``create_activation_matching``) pairs with those (each ``…_DequantizeLinear_Output``,
``…_DequantizeLinear_Output_1`` and ``…_QuantizeLinear_Input``, and the tensor itself).

Imports numpy, onnx and onnxruntime: call it from a loader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from epbuild.llm.calibrate import CONTEXT, ITERATOR, Chain, graph_of
from epbuild.llm.genai_config import EMBEDDINGS
from epbuild.llm.quantize import infer_shapes
from epbuild.llm.ranges import augment, calibrated_tensors
from epbuild.llm.sessions import SharedWeights, load_weights, structure

_PAIRED = ("_DequantizeLinear_Output", "_DequantizeLinear_Output_1", "_QuantizeLinear_Input")
"""The suffixes ``create_activation_matching`` pairs a QDQ tensor with its float one by."""
_PACKED = (TensorProto.INT4, TensorProto.UINT4)
"""Weight types stored two values a byte."""


class Augmented:
    """A CPU session of one graph that also outputs ``activations`` (no graph
    optimization, as ``qdq_loss_debug`` runs its graphs), and the graph's own
    ``outputs``."""

    def __init__(self, model: onnx.ModelProto, path: str, activations: Sequence[str]) -> None:
        self.outputs = [o.name for o in model.graph.output]
        self.activations = list(activations)
        augment(model, self.activations, minmax=False)
        folder = os.path.dirname(os.path.abspath(path))
        self.session = SharedWeights().session(model, folder, optimize=False)

    def run(
        self, feed: Mapping[str, Any], outputs: Sequence[str]
    ) -> tuple[list[Any], dict[str, list[Any]]]:
        """The graph's ``outputs`` and its activations (by name, one sample's each) on
        ``feed`` (the graph's inputs are taken from it by name)."""
        inputs = {i.name: feed[i.name] for i in self.session.get_inputs()}
        names = list(dict.fromkeys([*outputs, *self.activations]))
        values = dict(zip(names, self.session.run(names, inputs), strict=True))
        return [values[n] for n in outputs], {a: [values[a]] for a in self.activations}


def float_graph(path: str) -> tuple[onnx.ModelProto, list[str]]:
    """The float graph at ``path`` (without its weights, its shapes inferred) and the
    activations ``qdq_loss_debug`` would save of it."""
    model = infer_shapes(structure(path))
    ops = {n.op_type for n in model.graph.node}
    return model, calibrated_tensors(model, ops)


def weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s weights (read without them: their external data's)."""
    total = 0
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            ref = {e.key: e.value for e in tensor.external_data}
            total += int(ref.get("length", 0))
        else:
            total += len(tensor.raw_data)
    return total


def qdq_graph(path: str, floats: onnx.ModelProto, tensors: Sequence[str]) -> Augmented:
    """A session of the QDQ graph at ``path`` that outputs the tensors paired with the
    float graph's ``tensors`` (``floats``: the float graph, whose types they take: ONNX's
    shape inference does not know the com.microsoft Q/DQ ops of 16-bit types)."""
    model = structure(path)
    graph = model.graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*floats.graph.value_info, *floats.graph.output, *floats.graph.input)
    }
    wanted = set(tensors)
    known = {v.name for v in (*graph.value_info, *graph.output, *graph.input)}
    found: dict[str, None] = {}
    for node in graph.node:
        for out in node.output:
            for suffix in _PAIRED:
                base = out[: -len(suffix)] if out.endswith(suffix) else None
                if base in wanted:
                    found[out] = None
                    if suffix == _PAIRED[2]:
                        found[base] = None
    for name in found:
        if name not in known:
            base = next((name[: -len(s)] for s in _PAIRED if name.endswith(s)), name)
            graph.value_info.append(helper.make_tensor_value_info(name, types[base], None))
    produced = {out for node in graph.node for out in node.output}
    _inline_packed(model, os.path.dirname(os.path.abspath(path)))
    return Augmented(model, path, [n for n in found if n in produced])


def _inline_packed(model: onnx.ModelProto, folder: str) -> None:
    """The 4-bit weights of ``model`` read into it from ``folder``: ``SharedWeights``
    maps a weight's bytes as its element type, which packed 4-bit values are not."""
    packed = [
        t
        for t in model.graph.initializer
        if t.data_type in _PACKED and t.data_location == TensorProto.EXTERNAL
    ]
    if not packed:
        return
    holder = onnx.ModelProto()
    holder.graph.initializer.extend(packed)
    load_weights(holder, folder)
    for tensor, loaded in zip(packed, holder.graph.initializer, strict=True):
        tensor.CopyFrom(loaded)


def chains(
    graphs: Mapping[str, str],
    embeddings: str | None,
    stage: str,
    checked: Augmented,
    collect: Any,
) -> tuple[Chain, Chain]:
    """``calibrate.float_chains``, with ``checked``'s session in ``stage``'s place; for a
    context graph, the context chain up to it and no iterator chain (a context graph's
    feeds are the prompts' windows: no later part and no token is run)."""
    weights = SharedWeights()

    def session(name: str, path: str) -> Any:
        if name == stage:
            return checked.session
        return weights.session(structure(path), os.path.dirname(os.path.abspath(path)))

    first = [] if embeddings is None else [(EMBEDDINGS, session(EMBEDDINGS, embeddings))]
    if graph_of(stage) == CONTEXT:
        upto = [s for s in graphs if graph_of(s) == CONTEXT]
        upto = upto[: upto.index(stage) + 1]
        stages = [*first, *((s, session(s, graphs[s])) for s in upto)]
        return Upto(stages, collect), Chain([], collect)
    context, iterator = (
        Chain(
            [*first, *((s, session(s, p)) for s, p in graphs.items() if graph_of(s) == g)],
            collect,
        )
        for g in (CONTEXT, ITERATOR)
    )
    return context, iterator


class Upto(Chain):
    """A context chain that stops at a part before the last: the logits it does not make
    are zeros (one per position of the window, so that a window's greedy choice, which a
    context graph's feeds do not read, is token 0)."""

    def run(self, names: Sequence[str] | None, feed: Mapping[str, np.ndarray]) -> list[Any]:
        store = self.store(feed)
        window = next(iter(feed.values())).shape[1]
        absent = np.zeros((1, window, 1), np.float32)
        return [store.get(n, absent) for n in names or ()]
