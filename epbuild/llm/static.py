"""Static preparation: one dynamic-shape decoder, as onnxruntime-genai's model builder
writes it, turned into the two fixed-shape graphs genai's ``decoder-pipeline`` runs on an NPU.

- the ``context`` graph reads ``window_size`` tokens, the ``iterator`` graph one;
- the KV cache is fixed at ``[1, kv_heads, context_length, head_size]`` (past and present
  share the buffer, as genai's ``past_present_share_buffer`` wants);
- the ``attention_mask`` input and the subgraph that made ``GroupQueryAttention``'s
  ``seqlens_k`` and ``total_sequence_length`` from it are replaced by the inputs genai's
  pipeline feeds: ``past_seq_len`` (int32 ``[1, 1]``) and ``total_seq_len`` (int32 ``[1]``);
- each ``SkipSimplifiedLayerNormalization`` becomes ``Add`` + ``SimplifiedLayerNormalization``
  (the QNN EP has no builder for the fused op).

Every other node is kept. Imports onnx: call it only from a worker or a preparation step,
never on the planning path.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from epbuild._dataclass import dataclass
from epbuild.llm.genai_config import PAST_SEQ_LEN, TOTAL_SEQ_LEN

GQA = "GroupQueryAttention"
SKIP_NORM = "SkipSimplifiedLayerNormalization"
MASK = "attention_mask"
_SEQLENS_K = 5
_TOTAL_SEQUENCE_LENGTH = 6


class StaticPrepError(Exception):
    """The decoder does not have the structure the preparation rewrites."""


@dataclass(frozen=True)
class StaticShape:
    """The fixed shape of one prepared graph."""

    sequence: int
    """Tokens per run: ``window_size`` (context graph) or 1 (iterator graph)."""
    context_length: int
    """The KV cache's length."""
    head_size: int


def make_static(model: onnx.ModelProto, shape: StaticShape) -> onnx.ModelProto:
    """A fixed-shape copy of a builder-made decoder (``model`` is left as it was)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    attention = [n for n in graph.node if n.op_type == GQA]
    builder = "not a decoder as genai's model builder writes it"
    if not attention:
        raise StaticPrepError(f"no {GQA} node: {builder}")
    if MASK not in {i.name for i in graph.input}:
        raise StaticPrepError(f"no {MASK!r} input: {builder}")
    for node in attention:
        if len(node.input) <= _TOTAL_SEQUENCE_LENGTH:
            raise StaticPrepError(f"{GQA} node {node.name!r} has no seqlens_k input")
        node.input[_SEQLENS_K] = PAST_SEQ_LEN
        node.input[_TOTAL_SEQUENCE_LENGTH] = TOTAL_SEQ_LEN
    _split_skip_norms(graph)
    _fix_io(graph, shape)
    _drop_dead_nodes(graph)
    del graph.value_info[:]
    return out


def _split_skip_norms(graph: onnx.GraphProto) -> None:
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != SKIP_NORM:
            nodes.append(node)
            continue
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        outputs = list(node.output) + [""] * (4 - len(node.output))
        total = outputs[3] or f"{node.name}/Add/output_0"
        summed = total if len(node.input) < 4 or not node.input[3] else f"{node.name}/Add/sum"
        nodes.append(
            helper.make_node("Add", [node.input[0], node.input[1]], [summed], f"{node.name}/Add")
        )
        if summed != total:  # the optional bias
            nodes.append(
                helper.make_node("Add", [summed, node.input[3]], [total], f"{node.name}/AddBias")
            )
        nodes.append(
            helper.make_node(
                "SimplifiedLayerNormalization",
                [total, node.input[2]],
                [outputs[0]],
                f"{node.name}/Norm",
                axis=-1,
                epsilon=epsilon,
                stash_type=1,
            )
        )
    del graph.node[:]
    graph.node.extend(nodes)


def _dims(value: onnx.ValueInfoProto) -> list[onnx.TensorShapeProto.Dimension]:
    return list(value.type.tensor_type.shape.dim)


def _set_shape(value: onnx.ValueInfoProto, dims: list[int]) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = d


def _fix_io(graph: onnx.GraphProto, shape: StaticShape) -> None:
    inputs = [i for i in graph.input if i.name != MASK]
    for value in inputs:
        if value.name == "input_ids":
            _set_shape(value, [1, shape.sequence])
        elif len(_dims(value)) == 4:  # past_key_values.N.key / .value
            kv_heads = _dims(value)[1].dim_value
            _set_shape(value, [1, kv_heads, shape.context_length, shape.head_size])
    inputs.append(helper.make_tensor_value_info(PAST_SEQ_LEN, TensorProto.INT32, [1, 1]))
    inputs.append(helper.make_tensor_value_info(TOTAL_SEQ_LEN, TensorProto.INT32, [1]))
    del graph.input[:]
    graph.input.extend(inputs)
    for value in graph.output:
        dims = _dims(value)
        if value.name == "logits":
            _set_shape(value, [1, shape.sequence, dims[-1].dim_value])
        elif len(dims) == 4:
            _set_shape(value, [1, dims[1].dim_value, shape.context_length, shape.head_size])


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs is used (the old mask subgraph), then the
    initializers no node reads any more."""
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(o and o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)
