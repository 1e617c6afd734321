"""A small reader of the ONNX protobuf wire format, for the no-op path.

It reads only what epbuild needs (opsets, external-data references, EPContext nodes,
op-type counts, metadata, the main graph's input shapes) and must not import onnx,
onnxruntime or protobuf: importing onnx alone costs far more than a whole no-op build.
Length-delimited fields are skipped by offset; a big file is read in pages on demand
(``os.pread``), so ``raw_data`` is never read and a model of hundreds of MB costs about as
much as a small one. Files are not memory-mapped: a model truncated by another process
while it is read (an exporter rewriting it) would kill the reader with SIGBUS; a short
read is a clean ``ProtoError``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from typing import TypeAlias, TypeVar, overload

from epbuild._dataclass import dataclass

__all__ = [
    "Blob",
    "ContextNode",
    "ExternalRef",
    "GraphInput",
    "ModelInfo",
    "ProtoError",
    "StringField",
    "parse_external_refs",
    "parse_model",
    "read_external_refs",
    "read_model",
]

_Buf: TypeAlias = "bytes | memoryview | _PagedFile"
_Spec: TypeAlias = tuple[str, dict[int, int]]

# Big files are mostly raw_data that is skipped: read them in pages, on demand. Small or
# dense files read better in one go.
_PAGED_MIN = 64 << 20
_PAGE_BITS = 16
_MAX_DEPTH = 64  # nested subgraphs; protobuf itself stops at 100 messages deep
_INLINE_MAX = 64 << 10
"""String attributes longer than this (an embedded context binary) are not read: a `Blob`."""
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
_LOCATION = b"location"
"""The key of a tensor's external-data entry naming its file: no reference without it."""
_FLOAT, _INT, _STRING = 1, 2, 3  # AttributeProto.AttributeType


class ProtoError(ValueError):
    """The bytes are not a well-formed ONNX model (the caller adds the file name)."""


@dataclass(frozen=True)
class ExternalRef:
    """One tensor whose data lives in an external file."""

    tensor: str
    location: str
    offset: int | None
    length: int | None
    checksum: str | None


@dataclass(frozen=True)
class Blob:
    """A string attribute too long to be anything but a payload (an embedded context
    binary): only its size is known, its bytes are never read into memory."""

    size: int

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0


_AttrValue: TypeAlias = int | float | str | bytes | Blob


@dataclass(frozen=True)
class StringField:
    """One text field of a model where a path could be written (``read_model(strings=True)``).

    Doc strings, graph and node names, metadata (of the model and of nodes), tensor doc
    strings and every string attribute that is not a payload (an EPContext node's
    ``ep_cache_context`` is left out: the reference rule covers it as a path, and embedded
    it is the context's bytes).
    """

    field: str
    """What holds it: ``doc_string``, ``name``, ``attribute notes``, ``metadata_props['k']``."""
    value: str
    node: str | None = None
    """The node (or ``graph NAME`` / ``tensor NAME``) the field belongs to; None: the model."""


@dataclass(frozen=True)
class ContextNode:
    """An ``EPContext`` node of the main graph, with its scalar attributes."""

    name: str
    op_type: str
    domain: str
    attributes: dict[str, _AttrValue]


Dim: TypeAlias = int | str | None
"""One dimension of an input: a size (``dim_value``), a symbolic name (``dim_param``), or
None when the model gives neither."""


@dataclass(frozen=True)
class GraphInput:
    """A tensor input of the main graph (one that is not an initializer)."""

    name: str
    shape: tuple[Dim, ...] | None
    """Its dimensions; None when the model gives no shape (not even the rank)."""


@dataclass(frozen=True)
class ModelInfo:
    """What epbuild needs to know about a model file."""

    ir_version: int
    opsets: dict[str, int]
    external_refs: list[ExternalRef]
    context_nodes: list[ContextNode]
    op_types: dict[str, int]
    """Node count per op type over the main graph: ``"Conv"`` or ``"com.microsoft::EPContext"``."""
    metadata: dict[str, str]
    node_count: int
    """Nodes of the main graph (not of subgraphs or functions)."""
    strings: tuple[StringField, ...] = ()
    """Text fields where a path could be written; read only when asked (``strings=True``)."""
    inputs: tuple[GraphInput, ...] = ()
    """The main graph's tensor inputs, initializers left out (inputs of other types,
    sequences or maps, are not listed)."""


# Expected wire types (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32) of the known
# fields of each message; packable repeated scalars are left out since both forms are legal.
_MODEL: _Spec = ("ModelProto", dict.fromkeys((2, 3, 4, 6, 7, 8, 14, 20, 25, 26), 2) | {1: 0, 5: 0})
_OPSET: _Spec = ("OperatorSetIdProto", {1: 2, 2: 0})
_ENTRY: _Spec = ("StringStringEntryProto", {1: 2, 2: 2})
_TRAINING: _Spec = ("TrainingInfoProto", {1: 2, 2: 2, 3: 2, 4: 2})
_FUNCTION: _Spec = ("FunctionProto", dict.fromkeys((1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14), 2))
_GRAPH: _Spec = ("GraphProto", dict.fromkeys((1, 2, 5, 10, 11, 12, 13, 14, 15, 16), 2))
_NODE: _Spec = ("NodeProto", dict.fromkeys((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 2))
_ATTR: _Spec = (
    "AttributeProto",
    dict.fromkeys((1, 4, 5, 6, 9, 10, 11, 13, 14, 15, 21, 22, 23), 2) | {2: 5, 3: 0, 20: 0},
)
_TENSOR: _Spec = ("TensorProto", {2: 0, 3: 2, 6: 2, 8: 2, 9: 2, 12: 2, 13: 2, 14: 0, 16: 2})
_SPARSE: _Spec = ("SparseTensorProto", {1: 2, 2: 2})
_VALUE_INFO: _Spec = ("ValueInfoProto", {1: 2, 2: 2, 3: 2, 4: 2})
_TYPE: _Spec = ("TypeProto", {1: 2, 4: 2, 5: 2, 6: 2, 8: 2, 9: 2})
_TENSOR_TYPE: _Spec = ("TypeProto.Tensor", {1: 0, 2: 2})
_SHAPE: _Spec = ("TensorShapeProto", {1: 2})
_DIM: _Spec = ("TensorShapeProto.Dimension", {1: 0, 2: 2, 3: 2})


def _corrupt(pos: int) -> ProtoError:
    return ProtoError(f"truncated or corrupt protobuf at byte {pos}")


def _varint(buf: _Buf, pos: int, end: int) -> tuple[int, int]:
    start, result, shift = pos, 0, 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7
        if shift >= 70:
            break
    raise _corrupt(start)


def _fields(buf: _Buf, pos: int, end: int, spec: _Spec) -> Iterator[tuple[int, int, int]]:
    """Yield ``(field, a, b)``: a varint's value in ``a``; a length-delimited field's
    span ``[a, b)``; a fixed32/64 field's offset in ``a``."""
    message, wire_types = spec
    while pos < end:
        start = pos
        key = buf[pos]
        pos += 1
        if key >= 0x80:
            key, pos = _varint(buf, start, end)
        field, wt = key >> 3, key & 7
        if not field:
            raise ProtoError(f"invalid field number 0 at byte {start}")
        want = wire_types.get(field)
        if want is not None and want != wt:
            raise ProtoError(f"wrong wire type {wt} for {message} field {field} at byte {start}")
        if wt == 0 or wt == 2:
            if pos < end and buf[pos] < 0x80:  # one-byte varint: the common case
                val = buf[pos]
                pos += 1
            else:
                val, pos = _varint(buf, pos, end)
            if wt == 0:
                yield field, val, 0
                continue
            if pos + val > end:
                raise _corrupt(start)
            yield field, pos, pos + val
            pos += val
        elif wt == 5 or wt == 1:
            size = 4 if wt == 5 else 8
            if pos + size > end:
                raise _corrupt(start)
            yield field, pos, 0
            pos += size
        else:
            raise ProtoError(f"invalid wire type {wt} at byte {start}")


def _i64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _str(buf: _Buf, a: int, b: int) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError(f"invalid UTF-8 in a string at byte {a}") from None


def _entry(buf: _Buf, a: int, b: int) -> tuple[str, str]:
    if b - a >= 4 and buf[a] == 0x0A and buf[a + 1] < 0x80:  # key, then value: short ones
        mid = a + 2 + buf[a + 1]
        if (
            mid + 2 <= b
            and buf[mid] == 0x12
            and buf[mid + 1] < 0x80
            and mid + 2 + buf[mid + 1] == b
        ):
            return _str(buf, a + 2, mid), _str(buf, mid + 2, b)
    key = value = ""
    for f, s, e in _fields(buf, a, b, _ENTRY):
        if f == 1:
            key = _str(buf, s, e)
        elif f == 2:
            value = _str(buf, s, e)
    return key, value


def _int(value: str, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ProtoError(f"external data {what} is not an integer: {value!r}") from None


_CACHE = "ep_cache_context"


def _string_value(buf: _Buf, s: int, e: int) -> str | bytes | Blob:
    """A string attribute: text, bytes that are not UTF-8, or a `Blob` too long to read."""
    if e - s > _INLINE_MAX:
        return Blob(e - s)
    raw = bytes(buf[s:e])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


class _Reader:
    def __init__(self, buf: _Buf, strings: bool = False) -> None:
        self.buf = buf
        self.refs: list[ExternalRef] = []
        self.op_types: dict[str, int] = {}
        self.context_nodes: list[ContextNode] = []
        self.node_count = 0
        self.strings: list[StringField] | None = [] if strings else None
        self.inputs: list[GraphInput] = []

    def text(self, field: str, span: tuple[int, int], node: str | None = None) -> None:
        """Keep a non-empty text field (when strings are collected)."""
        if self.strings is not None and span[1] > span[0]:
            self.strings.append(StringField(field, _str(self.buf, *span), node))

    def tensor(self, a: int, b: int) -> tuple[int, int]:
        """Visit a tensor (its external data, its doc string); returns its name's span."""
        buf, name, location, entries = self.buf, (0, 0), 0, {}
        doc = (0, 0)
        for f, s, e in _fields(buf, a, b, _TENSOR):
            if f == 8:
                name = (s, e)
            elif f == 12:
                doc = (s, e)
            elif f == 13:
                key, value = _entry(buf, s, e)
                entries[key] = value
            elif f == 14:
                location = s
        if self.strings is not None and doc[1] > doc[0]:
            self.text("doc_string", doc, f"tensor {_str(buf, *name)}")
        if location != _EXTERNAL:
            return name
        tensor = _str(buf, *name)
        if "location" not in entries:
            raise ProtoError(f"external tensor {tensor!r} has no location")
        offset, length = entries.get("offset"), entries.get("length")
        self.refs.append(
            ExternalRef(
                tensor=tensor,
                location=entries["location"],
                offset=None if offset is None else _int(offset, "offset"),
                length=None if length is None else _int(length, "length"),
                checksum=entries.get("checksum"),
            )
        )
        return name

    def sparse(self, a: int, b: int) -> tuple[int, int]:
        """Visit a sparse tensor; returns the span of its name (its values' name)."""
        name = (0, 0)
        for f, s, e in _fields(self.buf, a, b, _SPARSE):
            if f in (1, 2):
                span = self.tensor(s, e)
                if f == 1:
                    name = span
        return name

    def graph(self, a: int, b: int, depth: int, main: bool) -> None:
        if depth > _MAX_DEPTH:
            raise ProtoError(f"subgraphs nested more than {_MAX_DEPTH} deep")
        name = doc = (0, 0)
        inputs: list[tuple[int, int]] = []
        initializers: set[bytes] = set()
        for f, s, e in _fields(self.buf, a, b, _GRAPH):
            if f == 1:
                self.node(s, e, depth, main)
            elif f == 2:
                name = (s, e)
            elif f == 5:
                span = self.tensor(s, e)
                if main:
                    initializers.add(bytes(self.buf[span[0] : span[1]]))
            elif f == 10:
                doc = (s, e)
            elif f == 11 and main:
                inputs.append((s, e))
            elif f == 15:
                span = self.sparse(s, e)
                if main:
                    initializers.add(bytes(self.buf[span[0] : span[1]]))
        for s, e in inputs:
            found = self.value_info(s, e, initializers)
            if found is not None:
                self.inputs.append(found)
        if self.strings is not None:
            graph = f"graph {_str(self.buf, *name)}"
            self.text("name", name, graph)
            self.text("doc_string", doc, graph)

    def value_info(self, a: int, b: int, initializers: set[bytes]) -> GraphInput | None:
        """A graph input that is a tensor and not an initializer, with its shape."""
        buf, name, tensor_type = self.buf, (0, 0), None
        for f, s, e in _fields(buf, a, b, _VALUE_INFO):
            if f == 1:
                name = (s, e)
            elif f == 2:
                for g, s2, e2 in _fields(buf, s, e, _TYPE):
                    if g == 1:
                        tensor_type = (s2, e2)
        if tensor_type is None or bytes(buf[name[0] : name[1]]) in initializers:
            return None
        shape: tuple[Dim, ...] | None = None
        for f, s, e in _fields(buf, *tensor_type, _TENSOR_TYPE):
            if f == 2:
                shape = tuple(self.dim(s2, e2) for g, s2, e2 in _fields(buf, s, e, _SHAPE))
        return GraphInput(_str(buf, *name), shape)

    def dim(self, a: int, b: int) -> Dim:
        value: Dim = None
        for f, s, e in _fields(self.buf, a, b, _DIM):
            if f == 1:
                value = _i64(s)
            elif f == 2:
                value = _str(self.buf, s, e)
        return value

    def node(self, a: int, b: int, depth: int, main: bool) -> None:
        buf, attrs, props = self.buf, [], []
        spans = {3: (0, 0), 4: (0, 0), 6: (0, 0), 7: (0, 0)}  # name, op_type, doc, domain
        for f, s, e in _fields(buf, a, b, _NODE):
            if f == 5:
                attrs.append((s, e))
            elif f == 9:
                props.append((s, e))
            elif f in spans:
                spans[f] = (s, e)
        op_type = _str(buf, *spans[4])
        context = main and op_type == "EPContext"
        texts = self.strings is not None
        if not (main or texts):  # a subgraph's or function's node: only its external data
            for s, e in attrs:
                self.attribute(s, e, depth, False)
            return
        name = _str(buf, *spans[3])
        values: dict[str, _AttrValue] = {}
        for s, e in attrs:
            item = self.attribute(s, e, depth, context or texts)
            if item is not None:
                values[item[0]] = item[1]
        if texts:
            assert self.strings is not None
            self.text("name", spans[3], name)
            self.text("doc_string", spans[6], name)
            for s, e in props:  # the dynamo exporter's stack traces, say
                prop, text = _entry(buf, s, e)
                if text:
                    self.strings.append(StringField(f"metadata_props[{prop!r}]", text, name))
            for attr, value in values.items():
                if isinstance(value, str) and not (op_type == "EPContext" and attr == _CACHE):
                    self.strings.append(StringField(f"attribute {attr}", value, name))
        if not main:
            return
        domain = _str(buf, *spans[7])
        self.node_count += 1
        key = op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"
        self.op_types[key] = self.op_types.get(key, 0) + 1
        if context:
            self.context_nodes.append(ContextNode(name, op_type, domain, values))

    def attribute(self, a: int, b: int, depth: int, decode: bool) -> tuple[str, _AttrValue] | None:
        """Visit an attribute's tensors and subgraphs; with ``decode``: its name and scalar
        value (None when it has none)."""
        buf, name, kind = self.buf, "", 0
        found: dict[int, _AttrValue] = {}
        for f, s, e in _fields(buf, a, b, _ATTR):
            if f in (5, 10):
                self.tensor(s, e)
            elif f in (22, 23):
                self.sparse(s, e)
            elif f in (6, 11):
                self.graph(s, e, depth + 1, False)
            elif not decode:
                continue
            elif f == 1:
                name = _str(buf, s, e)
            elif f == 20:
                kind = s
            elif f == 2:
                found[_FLOAT] = struct.unpack("<f", bytes(buf[s : s + 4]))[0]
            elif f == 3:
                found[_INT] = _i64(s)
            elif f == 4:
                found[_STRING] = _string_value(buf, s, e)
        if not decode:
            return None
        if not kind and len(found) == 1:  # old writers may leave `type` unset
            kind = next(iter(found))
        if kind in (_FLOAT, _INT, _STRING):
            return name, found.get(kind, (0.0, 0, "")[kind - 1])
        return None

    def beyond_graph(self, f: int, s: int, e: int) -> None:
        """A model's graphs outside its main graph: its training graphs (field 20) and its
        functions' nodes and attributes (field 25)."""
        buf = self.buf
        if f == 20:
            for g, s2, e2 in _fields(buf, s, e, _TRAINING):
                if g in (1, 2):
                    self.graph(s2, e2, 1, False)
        else:
            for g, s2, e2 in _fields(buf, s, e, _FUNCTION):
                if g == 7:
                    self.node(s2, e2, 1, False)
                elif g == 11:
                    self.attribute(s2, e2, 1, False)

    def model(self) -> ModelInfo:
        buf = self.buf
        ir_version, has_graph = 0, False
        opsets: dict[str, int] = {}
        metadata: dict[str, str] = {}
        for f, s, e in _fields(buf, 0, len(buf), _MODEL):
            if f == 1:
                ir_version = _i64(s)
            elif f == 7:
                has_graph = True
                self.graph(s, e, 0, True)
            elif f == 8:
                domain, version = "", 0
                for g, s2, e2 in _fields(buf, s, e, _OPSET):
                    if g == 1:
                        domain = _str(buf, s2, e2)
                    elif g == 2:
                        version = _i64(s2)
                opsets[domain] = version
            elif f == 6:
                self.text("doc_string", (s, e))
            elif f == 14:
                key, value = _entry(buf, s, e)
                metadata[key] = value
                if self.strings is not None and value:
                    self.strings.append(StringField(f"metadata_props[{key!r}]", value))
            elif f in (20, 25):
                self.beyond_graph(f, s, e)
        if not has_graph:
            raise ProtoError("no graph in the model")
        return ModelInfo(
            ir_version=ir_version,
            opsets=opsets,
            external_refs=self.refs,
            context_nodes=self.context_nodes,
            op_types=self.op_types,
            metadata=metadata,
            node_count=self.node_count,
            strings=tuple(self.strings or ()),
            inputs=tuple(self.inputs),
        )


def parse_model(data: bytes | memoryview, *, strings: bool = False) -> ModelInfo:
    """Read a serialized ModelProto; raises `ProtoError` if it is not one.

    With ``strings``, also the text fields where a path could be written (`StringField`).
    """
    if isinstance(data, memoryview) and (
        data.format != "B" or data.ndim != 1 or not data.c_contiguous
    ):
        data = data.tobytes()  # an unusual view: copy rather than cast
    if not len(data):
        raise ProtoError("empty file")
    return _Reader(data, strings).model()


class _PagedFile:
    """Read-only, indexable view of a file that reads (and keeps) only the pages touched."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.pages: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self.size

    def _page(self, number: int) -> bytes:
        page = self.pages.get(number)
        if page is None:
            start = number << _PAGE_BITS
            want = min(1 << _PAGE_BITS, self.size - start)
            page = os.pread(self.fd, want, start)
            if len(page) != want:
                raise ProtoError(f"the file shrank while it was being read (at byte {start})")
            self.pages[number] = page
        return page

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> bytes: ...
    def __getitem__(self, index: int | slice) -> int | bytes:
        mask = (1 << _PAGE_BITS) - 1
        if isinstance(index, int):
            if not 0 <= index < self.size:
                raise IndexError(index)
            return self._page(index >> _PAGE_BITS)[index & mask]
        start, stop, _ = index.indices(self.size)
        if stop <= start:
            return b""
        first, last = start >> _PAGE_BITS, (stop - 1) >> _PAGE_BITS
        if first == last:
            return self._page(first)[start & mask : (stop - 1 & mask) + 1]
        return b"".join(self._page(n) for n in range(first, last + 1))[
            start - (first << _PAGE_BITS) : stop - (first << _PAGE_BITS)
        ]


def read_model(path: str | os.PathLike[str], *, strings: bool = False) -> ModelInfo:
    """Read an ONNX file (external data files are not opened; see `parse_model`)."""
    return _read(path, lambda buf: _Reader(buf, strings).model())


_T = TypeVar("_T")


def _read(path: str | os.PathLike[str], read: Callable[[_Buf], _T]) -> _T:
    """``read`` of an ONNX file's bytes: read whole, or in pages (`_PagedFile`) from
    `_PAGED_MIN` bytes on; `ProtoError` for an empty file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ProtoError("empty file")
        return read(f.read() if size < _PAGED_MIN else _PagedFile(f.fileno(), size))


def _external_refs(buf: _Buf) -> list[ExternalRef]:
    """The external-data references `_Reader` finds, in its order, reading only the parts
    of the model that can hold one: a node, tensor or function whose bytes do not hold
    ``location`` (the key of the entry naming a reference's file) is skipped by its length.
    A file read in pages is not searched: each of those parts is read, as `_Reader` reads
    it. The wire types and lengths of the model's own fields are checked as `parse_model`
    checks them; a part that is skipped is not checked (so a tensor marked external without
    a ``location`` there goes unnoticed, where `parse_model` refuses it)."""
    reader = _Reader(buf)
    if isinstance(buf, bytes):
        whole = buf.find(_LOCATION) >= 0

        def may_hold(a: int, b: int) -> bool:
            return whole and buf.find(_LOCATION, a, b) >= 0
    else:

        def may_hold(a: int, b: int) -> bool:
            return True

    has_graph = False
    for f, s, e in _fields(buf, 0, len(buf), _MODEL):
        if f == 7:
            has_graph = True
            if may_hold(s, e):
                for g, s2, e2 in _fields(buf, s, e, _GRAPH):
                    if (g == 1 or g == 5 or g == 15) and may_hold(s2, e2):
                        if g == 1:
                            reader.node(s2, e2, 0, False)
                        elif g == 5:
                            reader.tensor(s2, e2)
                        else:
                            reader.sparse(s2, e2)
        elif f in (20, 25) and may_hold(s, e):
            reader.beyond_graph(f, s, e)
    if not has_graph:
        raise ProtoError("no graph in the model")
    return reader.refs


def parse_external_refs(data: bytes) -> list[ExternalRef]:
    """The external-data references of a serialized ModelProto: ``parse_model(data)
    .external_refs`` for a well-formed model, read in a small part of its time (the
    key of a model needs nothing else). Raises `ProtoError` for an empty file, a model
    without a graph or a field of the model that is cut short or of the wrong type; a
    malformed part that holds no reference goes unnoticed."""
    if not data:
        raise ProtoError("empty file")
    return _external_refs(bytes(data))


def read_external_refs(path: str | os.PathLike[str]) -> list[ExternalRef]:
    """`parse_external_refs` of an ONNX file (a big one is read in pages, as `read_model`
    reads it)."""
    return _read(path, _external_refs)
