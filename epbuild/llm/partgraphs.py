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
import stat
from collections.abc import Sequence
from typing import NamedTuple

import onnx
from onnx import TensorProto, helper

from epbuild._dataclass import dataclass
from epbuild.fs import copy_range, open_nofollow, same_bytes, zeros
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

_READ = os.O_RDONLY | getattr(os, "O_BINARY", 0)

EMBED_STAGE = 0
"""The stage index of ``embeddings``; part ``k`` is stage ``k``."""


@dataclass(frozen=True)
class PartShape:
    """What the preparation of parts needs besides the source."""

    window: int
    context: int
    head_size: int
    parts: int


def write_parts(
    model_path: str, out_dir: str, shape: PartShape, previous: str | None = None
) -> tuple[range, ...]:
    """Write ``embeddings.onnx`` and each part's ``context``/``iterator`` graphs with their
    data files into ``out_dir``; returns the layers of each part. ``previous``: the folder
    of the last preparation, whose data files are kept (hard-linked) where they already
    hold the bytes. ``StaticPrepError`` when the decoder cannot be cut."""
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
    embed_data = _DataFile(f"{EMBEDDINGS}.onnx.data", base)
    _save(embed, out_dir, f"{EMBEDDINGS}.onnx", embed_data)
    embed_data.write(out_dir, previous)
    described: dict[str, dict[str, list[str] | list[int]]] = {EMBEDDINGS: _io(embed)}
    for index in range(1, len(split) + 1):
        data = _DataFile(data_name(index), base)
        for graph, sequence in STAGE_SEQUENCES:
            static = statics[graph]
            seq = sequence or shape.window
            cut = _Cuts(static.graph, stages)
            part = _stage_model(static, cut, index, (1, seq, hidden), hidden_type, dynamic=False)
            name = stage_name(index, graph)
            _save(part, out_dir, f"{name}.onnx", data)
        data.write(out_dir, previous)
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


def _save(model: onnx.ModelProto, out_dir: str, name: str, data: _DataFile) -> None:
    """Save ``model`` as ``out_dir/name``, its external weights placed in ``data`` (written
    later, once every graph that shares it is placed)."""
    for tensor in model.graph.initializer:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        offset, length = data.place(tensor)
        del tensor.external_data[:]
        for key, value in (("location", data.name), ("offset", offset), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    onnx.save_model(model, os.path.join(out_dir, name))


class _Piece(NamedTuple):
    tensor: str
    location: str
    start: int
    length: int
    at: int


class _DataFile:
    """A data file of the preparation, laid out before it is written: each external weight
    of the graphs that share it gets its place (``place``), then its bytes are copied from
    the source's data, or the previous preparation's file is kept (``write``)."""

    def __init__(self, name: str, source_dir: str) -> None:
        self.name = name
        self.source_dir = source_dir
        self.size = 0
        self.pieces: list[_Piece] = []
        self.placed: dict[str, tuple[int, int]] = {}

    def place(self, tensor: onnx.TensorProto) -> tuple[int, int]:
        """Where ``tensor``'s bytes go (offset, length): at the end, aligned, the first
        time; where they already went when a graph placed it before."""
        if tensor.name in self.placed:
            return self.placed[tensor.name]
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if (
            not location
            or os.path.isabs(location)
            or ".." in location.replace("\\", "/").split("/")
        ):
            raise StaticPrepError(f"{tensor.name}: unusable external-data location {location!r}")
        start = int(info.get("offset", 0))
        if "length" in info:
            length = int(info["length"])
        else:
            length = os.path.getsize(os.path.join(self.source_dir, location)) - start
        offset = self.size
        if length >= _ALIGN_ABOVE and offset % _ALIGNMENT:
            offset += _ALIGNMENT - offset % _ALIGNMENT  # the gap reads as zeros
        self.pieces.append(_Piece(tensor.name, location, start, length, offset))
        self.size = offset + length
        self.placed[tensor.name] = (offset, length)
        return offset, length

    def write(self, out_dir: str, previous: str | None) -> None:
        """Write the file into ``out_dir`` (none when no weight was placed): a hard link to
        the previous preparation's file in ``previous`` where that holds these very bytes
        (after an edit of one part, the others' gigabytes are compared, not written again),
        else the bytes copied from the source's data."""
        if not self.pieces:
            return
        path = os.path.join(out_dir, self.name)
        if previous is not None and self._kept(os.path.join(previous, self.name), path):
            return
        with open(path, "wb") as out, _Sources(self.source_dir) as sources:
            for piece in self.pieces:
                src = sources.fd(piece.location)
                if (
                    copy_range(src, out.fileno(), piece.start, piece.length, piece.at)
                    != piece.length
                ):
                    raise StaticPrepError(f"{piece.tensor}: {piece.location} ends before its data")
            out.truncate(self.size)

    def _kept(self, previous: str, path: str) -> bool:
        """Link ``previous`` at ``path`` when it is a regular file holding exactly the bytes
        this file would (the same size, each weight's bytes, zeros between them)."""
        try:
            fd = open_nofollow(previous, os.O_RDONLY)
        except OSError:
            return False
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or before.st_size != self.size:
                return False
            if not self._held_by(fd):
                return False
        finally:
            os.close(fd)
        try:
            os.link(previous, path)
        except OSError:  # no hard links here: copy
            return False
        after = os.lstat(path)
        if (after.st_ino, after.st_dev, after.st_mtime_ns) != (
            before.st_ino,
            before.st_dev,
            before.st_mtime_ns,
        ):  # replaced meanwhile: what was compared is not what was linked
            os.unlink(path)
            return False
        return True

    def _held_by(self, fd: int) -> bool:
        at = 0
        with _Sources(self.source_dir) as sources:
            for piece in self.pieces:
                if piece.at > at and not zeros(fd, at, piece.at - at):
                    return False
                if not same_bytes(
                    sources.fd(piece.location), piece.start, fd, piece.at, piece.length
                ):
                    return False
                at = piece.at + piece.length
        return at == self.size


class _Sources:
    """The source's data files, each opened once, all closed on leaving the ``with``."""

    def __init__(self, source_dir: str) -> None:
        self.source_dir = source_dir
        self.open: dict[str, int] = {}

    def fd(self, location: str) -> int:
        if location not in self.open:
            self.open[location] = os.open(os.path.join(self.source_dir, location), _READ)
        return self.open[location]

    def __enter__(self) -> _Sources:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.open.values():
            os.close(fd)
