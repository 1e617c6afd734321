"""Edit an integer attribute of a model's main EPContext nodes without onnx or protobuf.

The compile worker may run in a provider's toolchain, which holds ONNX Runtime and its EP
but not the ``onnx`` package; the one edit it makes after compiling (the QNN spill-fill
size of a sharing group's ctx models) is done here on the wire format. Only the messages on
the path model → graph → node → attribute are re-encoded; every other byte is copied as is.
"""

from __future__ import annotations

from collections.abc import Callable

from epbuild.onnx.proto import ProtoError

_MODEL_GRAPH, _GRAPH_NODE, _NODE_OP_TYPE, _NODE_ATTRIBUTE = 7, 1, 4, 5
_ATTR_NAME, _ATTR_I, _ATTR_TYPE, _INT = 1, 3, 20, 2


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 70:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise ProtoError(f"truncated or corrupt protobuf at byte {pos}")


def _encode(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


_Field = tuple[int, int, int, int, int]
"""(field number, wire type, start of the key, start of the value, end of the field)."""


def _fields(buf: bytes) -> list[_Field]:
    fields: list[_Field] = []
    pos, end = 0, len(buf)
    while pos < end:
        start = pos
        key, pos = _varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        value = pos
        if wt == 0:
            _, pos = _varint(buf, pos, end)
        elif wt == 2:
            length, value = _varint(buf, pos, end)
            pos = value + length
        elif wt in (1, 5):
            pos += 8 if wt == 1 else 4
        else:
            raise ProtoError(f"invalid wire type {wt} at byte {start}")
        if not field or pos > end:
            raise ProtoError(f"truncated or corrupt protobuf at byte {start}")
        fields.append((field, wt, start, value, pos))
    return fields


def _delimited(field: int, payload: bytes) -> bytes:
    return _encode(field << 3 | 2) + _encode(len(payload)) + payload


def _rebuild(buf: bytes, field: int, edit: Callable[[bytes], bytes | None]) -> bytes | None:
    """``buf`` with each length-delimited ``field`` replaced by ``edit(payload)`` (None:
    unchanged); None when nothing changed."""
    out, changed, copied = bytearray(), False, 0
    for number, wt, start, value, end in _fields(buf):
        if number != field or wt != 2:
            continue
        new = edit(buf[value:end])
        if new is None:
            continue
        out += buf[copied:start] + _delimited(field, new)
        copied, changed = end, True
    return bytes(out + buf[copied:]) if changed else None


def _attribute(buf: bytes) -> tuple[str, int | None]:
    name, value = "", None
    for number, wt, _, start, end in _fields(buf):
        if number == _ATTR_NAME and wt == 2:
            name = buf[start:end].decode("utf-8", "replace")
        elif number == _ATTR_I and wt == 0:
            value = _varint(buf, start, end)[0]
    return name, value


def _int_attribute(name: str, value: int) -> bytes:
    return (
        _delimited(_ATTR_NAME, name.encode())
        + _encode(_ATTR_I << 3)
        + _encode(value)
        + _encode(_ATTR_TYPE << 3)
        + _encode(_INT)
    )


def _edit_node(buf: bytes, name: str, value: int) -> bytes | None:
    fields = _fields(buf)
    op_type = b"".join(buf[s:e] for n, wt, _, s, e in fields if n == _NODE_OP_TYPE and wt == 2)
    if op_type != b"EPContext":
        return None
    attrs = [(f, _attribute(buf[f[3] : f[4]])) for f in fields if f[0] == _NODE_ATTRIBUTE]
    if any(n == "main_context" and v == 0 for _, (n, v) in attrs):
        return None
    mine = [f for f, (n, _) in attrs if n == name]
    if mine and all(_attribute(buf[f[3] : f[4]])[1] == value for f in mine):
        return None
    new = _delimited(_NODE_ATTRIBUTE, _int_attribute(name, value))
    if mine:  # replace the attribute where it is
        _, _, start, _, end = mine[0]
        return buf[:start] + new + buf[end:]
    # after the last attribute (or the op type): where a protobuf writer puts it
    after = max(f[4] for f in fields if f[0] in (_NODE_ATTRIBUTE, _NODE_OP_TYPE))
    return buf[:after] + new + buf[after:]


def set_context_int(model: bytes, name: str, value: int) -> bytes | None:
    """The model with integer attribute ``name`` set to ``value`` on every main EPContext
    node of its main graph (``main_context`` absent or 1); None when nothing changes."""

    def graph(buf: bytes) -> bytes | None:
        return _rebuild(buf, _GRAPH_NODE, lambda node: _edit_node(node, name, value))

    return _rebuild(model, _MODEL_GRAPH, graph)
