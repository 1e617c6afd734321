"""One static LLM graph (``epbuild.llm.static``) made a QDQ graph the QNN EP compiles into
one EPContext node, from its calibrated ranges, through ONNX Runtime's QNN quantization
config, past the two traps measured on these graphs:

- ONNX's shape inference stops at ``GroupQueryAttention`` (a contrib op), and the quantizer
  skips every tensor whose type it does not know: the graph is first given every tensor's
  type and shape by ORT's symbolic shape inference (``auto_merge``), for the calibration and
  the quantization alike (``infer_shapes``);
- the quantizer renames ``GroupQueryAttention``'s inputs and outputs (``X`` becomes
  ``X_DequantizeLinear_Output`` / ``X_QuantizeLinear_Input``) without their shapes, and the
  QNN EP refuses a node whose input has none ("Cannot get shape"), leaving every attention
  on the CPU: the float tensors' shapes are copied onto them (``restore_shapes``).

Imports onnx and onnxruntime: call it from a worker.
"""

from __future__ import annotations

import difflib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from epbuild.errors import ModelError
from epbuild.llm.sessions import structure
from epbuild.quant.work import _check_names, _config, _names, _qtype, _quantize, stage_model

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
RENAMED = ("_DequantizeLinear_Output", "_QuantizeLinear_Input")
"""Suffixes ONNX Runtime's quantizer gives the float tensors it puts a Q/DQ pair on."""


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every tensor's type and shape (symbolic shape inference, which knows
    ORT's contrib ops)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    inferred: onnx.ModelProto = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    return inferred


def restore_shapes(qdq: onnx.ModelProto, floating: onnx.ModelProto) -> int:
    """Give each tensor the quantizer renamed without a type (``RENAMED``) the float
    tensor's type and shape (from ``floating``, the inferred float graph); returns how many
    it gave."""
    graph = qdq.graph
    known = {v.name for v in (*graph.value_info, *graph.input, *graph.output)}
    known |= {t.name for t in graph.initializer}
    values = {v.name: v for v in (*floating.graph.value_info, *floating.graph.input)}
    values.update({v.name: v for v in floating.graph.output})
    weights = {t.name: t for t in floating.graph.initializer}
    added = 0
    for node in graph.node:
        for name in (*node.input, *node.output):
            if not name or name in known:
                continue
            original = next((name[: -len(s)] for s in RENAMED if name.endswith(s)), None)
            if original in values:
                value = onnx.ValueInfoProto()
                value.CopyFrom(values[original])
                value.name = name
            elif original in weights:
                weight = weights[original]
                value = onnx.helper.make_tensor_value_info(name, weight.data_type, weight.dims)
            else:
                continue
            graph.value_info.append(value)
            known.add(name)
            added += 1
    return added


def per_channel_matmuls(
    model: onnx.ModelProto, extra_options: dict[str, Any], settings: Mapping[str, Any]
) -> int:
    """Quantize each MatMul weight per output channel (axis 1), symmetric: ORT's QNN
    config keeps MatMul weights per tensor even with ``per_channel`` (its Conv weights
    only follow it), while an LLM's weights are MatMuls; the HTP runs these (measured:
    int8 and uint8 per channel generate the float model's tokens). A tensor in
    ``overrides`` keeps its type there. Returns the count of weights."""
    weights = {t.name for t in model.graph.initializer}
    overrides = extra_options.setdefault("TensorQuantOverrides", {})
    types = dict(settings["overrides"])
    count = 0
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or node.input[1] not in weights:
            continue
        name = node.input[1]
        kind = _qtype(types.get(name, settings["weights"]))
        overrides[name] = [{"quant_type": kind, "symmetric": True, "axis": 1}]
        count += 1
    return count


def own_names(
    floating: onnx.ModelProto, settings: Mapping[str, Any], siblings: Sequence[str], label: str
) -> dict[str, Any]:
    """``settings`` with ``exclude`` and ``overrides`` narrowed to the names ``floating``
    has, each other name given by one of ``siblings`` (the other graphs of a decoder in
    parts): a node of the last part (the ``lm_head``) is that part's alone. A name none of
    them has is a ``ModelError`` naming ``label``'s key, with the nearest names of all."""
    overrides: dict[str, str] = dict(settings["overrides"])
    wanted = {"exclude": list(settings["exclude"]), "overrides": list(overrides)}
    if not siblings or not any(wanted.values()):
        return dict(settings)
    own = {key: _names(floating, key) for key in wanted}
    known = {key: set(names) for key, names in own.items()}
    for path in siblings:
        other = structure(path)
        for key, names in known.items():
            names |= _names(other, key)
    for key, what in (("exclude", "node"), ("overrides", "tensor")):
        unknown = [n for n in wanted[key] if n not in known[key]]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known[key]), n=3)
            raise ModelError(
                f"{label}: {key} names {what} {unknown[0]!r}, which no part of the decoder has",
                hint=f"did you mean {' or '.join(repr(n) for n in near)}?"
                if near
                else f"use the {what} names the decoder has (Netron shows them)",
            )
    exclude = [n for n in wanted["exclude"] if n in own["exclude"]]
    kept = {n: t for n, t in overrides.items() if n in own["overrides"]}
    return {**settings, "exclude": exclude, "overrides": kept}


def quantize_graph(
    source: str,
    ranges: str,
    output: str,
    settings: Mapping[str, Any],
    label: str,
    siblings: Sequence[str] = (),
) -> int:
    """Write the QDQ graph of the float static graph ``source`` at ``output`` (external data
    beside it) from the calibration's ``ranges`` (ORT's calibration cache) with
    ``settings`` (``activations``, ``weights``, ``per_channel``, ``method``, ``exclude``,
    ``overrides``: the manifest's); returns its count of Q/DQ nodes. ``label`` names the
    graph and recipe in a ``ModelError`` (a name no graph has); ``siblings``: the other
    part graphs of a decoder in parts, whose names ``exclude`` and ``overrides`` may give
    (``own_names``)."""
    floating = infer_shapes(structure(source))  # its weights stay in their files
    settings = own_names(floating, settings, siblings, label)
    _check_names(floating, label, list(settings["exclude"]), dict(settings["overrides"]))
    for path in (output, output + ".data"):  # onnx appends to a data file there
        if os.path.lexists(path):
            os.unlink(path)
    with tempfile.TemporaryDirectory(prefix="epbuild-llmquant-") as tmp:
        inferred = os.path.join(tmp, "float.onnx")
        stage_model(floating, source, inferred)
        cache = os.path.join(tmp, "ranges.json")  # ORT may rewrite a cache: never the committed one
        shutil.copyfile(ranges, cache)
        config = _config(inferred, {**settings, "flavour": "qnn"})
        if settings["per_channel"]:
            per_channel_matmuls(floating, config.extra_options, settings)
        _quantize(inferred, output, cache, config, True)  # its weights in <name>.onnx.data
    qdq = onnx.load(output, load_external_data=False)
    restore_shapes(qdq, floating)
    onnx.save(qdq, output)  # the graph alone: its weights stay where the quantizer wrote them
    return sum(1 for n in qdq.graph.node if n.op_type in QDQ_OPS)
