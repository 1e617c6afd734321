"""A builder-made decoder cut into the graphs of its parts (``llm.parts``), written one part
at a time with bounded memory: the source is read without its weights, each static graph
(``llm.static``) is cut at layer boundaries, and each part's weights are copied from the
source's external data into the part's own data file (in the kernel where it can), so that
the preparing process holds graph structure, never a part's weights.

Each node goes to one stage: a node named after a layer (``/layers.<i>/``) to the part of
its layer; a node that depends on ``input_ids`` alone (the embedding lookup) to the CPU
``embeddings`` stage; any other to the latest stage of what it reads (the final norm and
``lm_head`` to the last part); a node that reads only the previous part's activations
(the residual ``Add`` that opens a layer) runs at the end of that part, so that one tensor
crosses each cut. A ``Constant`` goes into every stage that reads it. What crosses a cut is
the residual stream, ``[1, sequence, hidden]`` in the embedding's type.

Imports onnx: call it only from a worker.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from epbuild._dataclass import dataclass
from epbuild.fs import copy_range
from epbuild.llm.genai_config import EMBEDDINGS
from epbuild.llm.parts import PARTS_JSON, STAGE_SEQUENCES, data_name, part_name, stage_name
from epbuild.llm.sizes import split_layers, weight_sizes
from epbuild.llm.static import GQA, StaticPrepError, StaticShape, make_static

_NODE_LAYER = re.compile(r"/layers\.(\d+)/")
_INPUT_IDS = "input_ids"
_ALIGN_ABOVE = 1 << 20
_ALIGNMENT = 4096
"""Tensors of at least ``_ALIGN_ABOVE`` bytes start at a multiple of ``_ALIGNMENT`` (as
onnx's own writer aligns them), so that a runtime may map them."""

EMBED_STAGE = 0
"""The stage index of ``embeddings``; part ``k`` is stage ``k``."""


@dataclass(frozen=True)
class PartShape:
    """What the preparation of parts needs besides the source."""

    window: int
    context: int
    head_size: int
    parts: int


def write_parts(model_path: str, out_dir: str, shape: PartShape) -> tuple[range, ...]:
    """Write ``embeddings.onnx`` and each part's ``context``/``iterator`` graphs with their
    data files into ``out_dir``; returns the layers of each part. ``StaticPrepError`` when
    the decoder cannot be cut."""
    source = onnx.load(model_path, load_external_data=False)
    layers = sum(n.op_type == GQA for n in source.graph.node)
    try:
        split = split_layers(weight_sizes(model_path, layers), shape.parts)
    except ValueError as exc:
        raise StaticPrepError(f"it has {layers} layers, too few for {shape.parts} parts") from exc
    base = os.path.dirname(model_path)
    statics = {
        graph: make_static(
            source, StaticShape(sequence or shape.window, shape.context, shape.head_size)
        )
        for graph, sequence in STAGE_SEQUENCES
    }
    del source
    first = next(iter(statics.values()))
    stages = _assign(first.graph, split)
    cuts = _Cuts(first.graph, stages)
    hidden_type, hidden = _hidden(first.graph, cuts)
    free = ("batch_size", "sequence_length", hidden)
    embed = _stage_model(first, cuts, EMBED_STAGE, free, hidden_type, dynamic=True)
    _write(embed, base, out_dir, f"{EMBEDDINGS}.onnx", f"{EMBEDDINGS}.onnx.data")
    described: dict[str, dict[str, list[str] | list[int]]] = {EMBEDDINGS: _io(embed)}
    for index in range(1, len(split) + 1):
        placed: dict[str, tuple[int, int]] = {}
        for graph, sequence in STAGE_SEQUENCES:
            static = statics[graph]
            seq = sequence or shape.window
            cut = _Cuts(static.graph, stages)
            part = _stage_model(static, cut, index, (1, seq, hidden), hidden_type, dynamic=False)
            name = stage_name(index, graph)
            _write(part, base, out_dir, f"{name}.onnx", data_name(index), placed)
        layers = split[index - 1]
        described[part_name(index)] = {**_io(part), "layers": [layers.start, layers.stop - 1]}
    with open(os.path.join(out_dir, PARTS_JSON), "w", encoding="utf-8") as f:
        json.dump(described, f, indent=1)
    return split


def _io(model: onnx.ModelProto) -> dict[str, list[str] | list[int]]:
    """A stage's input and output names, for genai's pipeline config."""
    return {
        "inputs": [v.name for v in model.graph.input],
        "outputs": [v.name for v in model.graph.output],
    }


def _assign(graph: onnx.GraphProto, split: Sequence[range]) -> list[int]:
    """The stage of each node of ``graph`` (-1: a ``Constant``, copied where it is read)."""
    part_of = {layer: k for k, layers in enumerate(split, start=1) for layer in layers}
    last = len(split)
    weights = {t.name for t in graph.initializer}
    free = {o for n in graph.node if not n.input for o in n.output}
    producer: dict[str, int] = {}
    stage: list[int] = []
    embedding: set[str] = {_INPUT_IDS}
    for i, node in enumerate(graph.node):
        found = _NODE_LAYER.search(node.name)
        reads = [x for x in node.input if x and x not in weights and x not in free]
        if not node.input:
            stage.append(-1)
        elif found and int(found.group(1)) in part_of:
            stage.append(part_of[int(found.group(1))])
        elif reads and all(x in embedding for x in reads):
            stage.append(EMBED_STAGE)
            embedding.update(o for o in node.output if o)
        else:
            before = [stage[producer[x]] for x in reads if x in producer]
            stage.append(min(max(max(before, default=1), 1), last))
        for out in node.output:
            if out:
                producer[out] = i
    # A node reading only the previous part's activations runs at the end of that part.
    for i, node in enumerate(graph.node):
        reads = [x for x in node.input if x]
        if stage[i] < 2 or not reads or any(x in weights or x not in producer for x in reads):
            continue
        if all(stage[producer[x]] == stage[i] - 1 for x in reads):
            stage[i] -= 1
    if EMBED_STAGE not in stage:
        raise StaticPrepError(f"no embedding lookup reads {_INPUT_IDS!r} alone")
    return stage


class _Cuts:
    """Who produces and who reads each tensor of a graph whose nodes are assigned."""

    def __init__(self, graph: onnx.GraphProto, stages: list[int]) -> None:
        self.graph = graph
        self.stages = stages
        self.producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
        self.weights = {t.name: t for t in graph.initializer}
        self.inputs = {v.name: v for v in graph.input}
        self.outputs = {v.name: v for v in graph.output}
        self.readers: dict[str, set[int]] = {}
        for i, node in enumerate(graph.node):
            for x in node.input:
                if x and x not in self.weights:
                    self.readers.setdefault(x, set()).add(stages[i])

    def crossing(self, stage: int) -> tuple[list[str], list[str]]:
        """The tensors ``stage`` reads from earlier stages and writes for later ones, in
        graph order (graph inputs and outputs included)."""
        reads: list[str] = []
        writes: list[str] = []
        for i, node in enumerate(self.graph.node):
            if self.stages[i] != stage:
                continue
            for x in node.input:
                if not x or x in self.weights or x in reads:
                    continue
                at = self.producer.get(x)
                if at is None or (self.stages[at] not in (stage, -1)):
                    if at is not None and self.stages[at] > stage:
                        raise StaticPrepError(f"{x!r} is read before the part that makes it")
                    reads.append(x)
            for out in node.output:
                later = {s for s in self.readers.get(out, ()) if s != stage}
                if out and (out in self.outputs or later):
                    writes.append(out)
        return reads, writes


def _hidden(graph: onnx.GraphProto, cuts: _Cuts) -> tuple[int, int]:
    """The residual stream's element type and width: those of the embedding table."""
    for i, node in enumerate(graph.node):
        if cuts.stages[i] == EMBED_STAGE and node.op_type == "Gather":
            table = cuts.weights.get(node.input[0])
            if table is not None and len(table.dims) == 2:
                return table.data_type, int(table.dims[1])
    raise StaticPrepError("no embedding table (a Gather of a [vocab, hidden] weight)")


def _stage_model(
    static: onnx.ModelProto,
    cuts: _Cuts,
    stage: int,
    hidden_shape: tuple[int | str, ...],
    hidden_type: int,
    *,
    dynamic: bool,
) -> onnx.ModelProto:
    """The graph of one stage: its nodes (and the ``Constant`` nodes they read), its
    weights (still referring to the source's data), the tensors crossing its cuts as
    inputs and outputs."""
    graph = static.graph
    reads, writes = cuts.crossing(stage)
    own = [n for i, n in enumerate(graph.node) if cuts.stages[i] == stage]
    used = {x for n in own for x in n.input if x}
    constants = [
        n for i, n in enumerate(graph.node) if cuts.stages[i] == -1 and set(n.output) & used
    ]
    inputs = [_value(cuts, x, hidden_shape, hidden_type, dynamic, cuts.inputs) for x in reads]
    outputs = [_value(cuts, x, hidden_shape, hidden_type, dynamic, cuts.outputs) for x in writes]
    weights = [t for t in graph.initializer if t.name in used]
    part = helper.make_graph([*constants, *own], graph.name, inputs, outputs, weights)
    model = helper.make_model(part, opset_imports=static.opset_import)
    model.ir_version = static.ir_version
    model.producer_name = static.producer_name
    return model


def _value(
    cuts: _Cuts,
    name: str,
    hidden_shape: tuple[int | str, ...],
    hidden_type: int,
    dynamic: bool,
    known: dict[str, onnx.ValueInfoProto],
) -> onnx.ValueInfoProto:
    """A stage's input or output: as the static graph declares it, else the residual
    stream (``input_ids`` of the CPU stage keeps the source's free dimensions)."""
    if name == _INPUT_IDS and dynamic:
        free = ["batch_size", "sequence_length"]
        return helper.make_tensor_value_info(name, TensorProto.INT64, free)
    if name in known:
        value = onnx.ValueInfoProto()
        value.CopyFrom(known[name])
        return value
    return helper.make_tensor_value_info(name, hidden_type, list(hidden_shape))


def _write(
    model: onnx.ModelProto,
    source_dir: str,
    out_dir: str,
    name: str,
    data: str,
    placed: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Save ``model`` as ``out_dir/name``, its external weights copied from the source's
    data into ``out_dir/data`` (appended; ``placed`` remembers what an earlier graph of the
    same part wrote there, so that both graphs share one copy)."""
    placed = {} if placed is None else placed
    path = os.path.join(out_dir, data)
    with open(path, "r+b" if os.path.exists(path) else "w+b") as out:
        for tensor in model.graph.initializer:
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            if tensor.name not in placed:
                placed[tensor.name] = _append(out.fileno(), source_dir, tensor)
            offset, length = placed[tensor.name]
            del tensor.external_data[:]
            for key, value in (("location", data), ("offset", offset), ("length", length)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
    if os.path.getsize(path) == 0:
        os.unlink(path)
    onnx.save_model(model, os.path.join(out_dir, name))


def _append(out: int, source_dir: str, tensor: onnx.TensorProto) -> tuple[int, int]:
    """Copy ``tensor``'s bytes from its source data file to the end of the open file
    ``out`` (in the kernel where it can: ``copy_range``); returns where they now are."""
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    if not location or os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
        raise StaticPrepError(f"{tensor.name}: unusable external-data location {location!r}")
    start = int(info.get("offset", 0))
    with open(os.path.join(source_dir, location), "rb") as src:
        length = int(info["length"]) if "length" in info else os.fstat(src.fileno()).st_size - start
        offset = os.fstat(out).st_size
        if length >= _ALIGN_ABOVE and offset % _ALIGNMENT:
            offset += _ALIGNMENT - offset % _ALIGNMENT  # the gap reads as zeros
        if copy_range(src.fileno(), out, start, length, offset) != length:
            raise StaticPrepError(f"{tensor.name}: {location} ends before its data")
    return offset, length
